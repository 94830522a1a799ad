"""Helpers the tests share (tests/conftest.py puts tests/ on ``sys.path``, so every test directory
imports them as ``support.<module>``): rank process pools (mp_pool), GPU test processes that may
hang (procs), per-rank inputs (rank_cases), the native test builds (native: the test-only C++
bindings; emulated_cuda: CUDA kernels built for the CPU) and the codec kernels' cases
(codec_kernel_cases)."""
