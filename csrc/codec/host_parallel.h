// Host-only parallel loop for the codec bindings: items are claimed dynamically from an atomic
// counter by `threads` std::threads (the caller being one of them). Threads that wait block in
// join instead of spinning, so a busy or oversubscribed host does not lose the core that the
// working threads need (OpenMP's default spin-wait made 2 threads 10x slower than 1 on a loaded
// 2-core machine, measured with bench/codec_bench.py).
#pragma once
#include <atomic>
#include <cstdint>
#include <thread>
#include <vector>

namespace ep_comm::host {

inline int hardware_threads() {
  unsigned n = std::thread::hardware_concurrency();
  return n > 0 ? static_cast<int>(n) : 1;
}

// Calls fn(i) for i in [0, n), on up to `threads` threads. fn must not throw.
template <typename F>
void parallel_for(int64_t n, int threads, F&& fn) {
  if (threads > n) threads = static_cast<int>(n);
  if (threads <= 1) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  std::atomic<int64_t> next{0};
  auto work = [&] {
    for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) fn(i);
  };
  std::vector<std::thread> pool;
  pool.reserve(threads - 1);
  for (int t = 1; t < threads; ++t) pool.emplace_back(work);
  work();
  for (auto& th : pool) th.join();
}

}  // namespace ep_comm::host
