// ep_comm._host: the CPU build of the C++ cores (codecs, routing helpers) that the CUDA kernels
// compile too; the CPU tests run this build.
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
