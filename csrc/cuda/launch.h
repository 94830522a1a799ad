// Kernel launches that also compile in the CUDA emulation (csrc/emulation/cuda_runtime.h):
//   EP_LAUNCH(kernel, grid, threads, stream)(args...)
// is kernel<<<grid, threads, 0, stream>>>(args...) under nvcc, and runs the kernel on the CPU when
// built with -DEP_CUDA_EMULATION.
#pragma once
#include <cuda_runtime.h>

// EP_LAUNCH_SMEM(kernel, grid, threads, shared_bytes, stream)(args...) also gives each block
// shared_bytes of dynamic shared memory, which the kernel declares with
// EP_DYNAMIC_SHARED(type, name) (extern __shared__ type name[] under nvcc).
#ifdef EP_CUDA_EMULATION
#define EP_LAUNCH(kernel, grid, threads, stream) ::ep_emu::launch(kernel, (grid), (threads), 0, (stream))
#define EP_LAUNCH_SMEM(kernel, grid, threads, shared_bytes, stream) \
  ::ep_emu::launch(kernel, (grid), (threads), (shared_bytes), (stream))
#define EP_DYNAMIC_SHARED(type, name) type* const name = static_cast<type*>(::ep_emu::dynamic_shared_memory())
#else
#define EP_LAUNCH(kernel, grid, threads, stream) kernel<<<(grid), (threads), 0, (stream)>>>
#define EP_LAUNCH_SMEM(kernel, grid, threads, shared_bytes, stream) \
  kernel<<<(grid), (threads), (shared_bytes), (stream)>>>
#define EP_DYNAMIC_SHARED(type, name) extern __shared__ type name[]
#endif
