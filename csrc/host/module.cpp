// ep_comm._host: the CPU build of the C++ cores that the CUDA kernels compile too, bound for what
// the product calls (codecs, row copies and sums, buffer layouts); the CPU tests run this build.
// The cores' test-only bindings are built by the tests (tests/native/host_test_bindings.cpp).
#include "bindings.h"

PYBIND11_MODULE(_host, m) {
  m.doc() = "ep_comm host build of the shared C++/CUDA cores";
  ep_comm::host::register_lossless(m);
  ep_comm::host::register_fp8(m);
  ep_comm::host::register_routing(m);
  ep_comm::host::register_hierarchy(m);
  ep_comm::host::register_row_reduce(m);
  ep_comm::host::register_row_copy(m);
}
