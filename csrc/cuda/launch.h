// Kernel launches that also compile in the CUDA emulation (csrc/emulation/cuda_runtime.h):
//   EP_LAUNCH(kernel, grid, threads, stream)(args...)
// is kernel<<<grid, threads, 0, stream>>>(args...) under nvcc, and runs the kernel on the CPU when
// built with -DEP_CUDA_EMULATION.
#pragma once
#include <cuda_runtime.h>

#ifdef EP_CUDA_EMULATION
#define EP_LAUNCH(kernel, grid, threads, stream) ((void)(stream), ::ep_emu::launch(kernel, (grid), (threads)))
#else
#define EP_LAUNCH(kernel, grid, threads, stream) kernel<<<(grid), (threads), 0, (stream)>>>
#endif
