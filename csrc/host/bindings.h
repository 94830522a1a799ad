// Registration functions of the host (CPU) build of ep_comm's C++ cores.
// Each file in csrc/host/ binds one job and defines one of these; module.cpp calls them all.
#pragma once
#include <pybind11/pybind11.h>

namespace ep_comm::host {
void register_lossless(pybind11::module_& m);
void register_fp8(pybind11::module_& m);
void register_routing(pybind11::module_& m);
void register_hierarchy(pybind11::module_& m);
void register_row_reduce(pybind11::module_& m);
void register_row_copy(pybind11::module_& m);
}  // namespace ep_comm::host
