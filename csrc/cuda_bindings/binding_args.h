// The argument conventions of ep_comm._cuda's bindings (module.cpp, peer_kernels.cpp): tensors arrive
// as data pointers (Python ints, None for nullptr) in dicts keyed by the C++ field names, streams as
// raw cudaStream_t handles; a failed launch raises RuntimeError.
#pragma once
#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "launchers.h"

namespace ep_comm::cuda::bindings {

namespace py = pybind11;

template <class T>
inline T* ptr(const py::dict& d, const char* key) {
  if (!d.contains(key)) throw std::invalid_argument(std::string("missing field: ") + key);
  py::object v = d[key];
  if (v.is_none()) return nullptr;
  return reinterpret_cast<T*>(v.cast<uintptr_t>());
}
template <class T>
inline T num(const py::dict& d, const char* key) {
  if (!d.contains(key)) throw std::invalid_argument(std::string("missing field: ") + key);
  return d[key].cast<T>();
}
inline void* stream_of(uintptr_t s) { return reinterpret_cast<void*>(s); }

// Raises RuntimeError when the launch (or anything before it on this thread) failed.
inline void check_launch(const char* what) {
  if (const char* error = take_launch_error()) throw std::runtime_error(std::string(what) + ": " + error);
}

}  // namespace ep_comm::cuda::bindings
