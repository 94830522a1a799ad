// Running C++ work without the GIL, for the host bindings.
#pragma once
#include <pybind11/pybind11.h>

#include <exception>
#include <type_traits>

namespace ep_comm::host {

// Runs work() (which must not touch Python) with the GIL released, and takes the GIL back in
// plain code rather than in a destructor, as py::gil_scoped_release does: in a daemon thread at
// interpreter exit, taking the GIL back ends the thread by pthread_exit, and that unwinding
// through a destructor (noexcept) aborted the process ("terminate called without an active
// exception"). An exception from work() is rethrown once the GIL is held again.
template <typename F>
auto without_gil(F&& work) -> decltype(work()) {
  using Result = decltype(work());
  PyThreadState* state = PyEval_SaveThread();
  std::exception_ptr error;
  if constexpr (std::is_void_v<Result>) {
    try {
      work();
    } catch (...) {
      error = std::current_exception();
    }
    PyEval_RestoreThread(state);
    if (error) std::rethrow_exception(error);
  } else {
    Result result{};
    try {
      result = work();
    } catch (...) {
      error = std::current_exception();
    }
    PyEval_RestoreThread(state);
    if (error) std::rethrow_exception(error);
    return result;
  }
}

}  // namespace ep_comm::host
