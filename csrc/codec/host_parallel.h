// Host-only parallel loop for the codec bindings: items are claimed dynamically from an atomic
// counter by `threads` std::threads (the caller being one of them). Threads that wait block in
// join instead of spinning, so a busy or oversubscribed host does not lose the core that the
// working threads need (OpenMP's default spin-wait made 2 threads 10x slower than 1 on a loaded
// 2-core machine, measured with bench/codec_bench.py).
#pragma once
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <thread>
#include <vector>

namespace ep_comm::host {

inline int hardware_threads() {
  unsigned n = std::thread::hardware_concurrency();
  return n > 0 ? static_cast<int>(n) : 1;
}

// Calls fn(worker, i) for i in [0, n), on up to `threads` threads (worker in [0, threads): the
// calling thread is worker 0), which claim runs of `grain` consecutive indices in increasing
// order. fn must not throw.
template <typename F>
void parallel_for_workers(int64_t n, int threads, F&& fn, int64_t grain = 1) {
  if (grain < 1) grain = 1;
  const int64_t runs = (n + grain - 1) / grain;
  if (threads > runs) threads = static_cast<int>(runs);
  if (threads <= 1) {
    for (int64_t i = 0; i < n; ++i) fn(0, i);
    return;
  }
  std::atomic<int64_t> next{0};
  auto work = [&](int worker) {
    for (int64_t r = next.fetch_add(1); r < runs; r = next.fetch_add(1))
      for (int64_t i = r * grain, end = std::min(n, i + grain); i < end; ++i) fn(worker, i);
  };
  std::vector<std::thread> pool;
  pool.reserve(threads - 1);
  for (int t = 1; t < threads; ++t) pool.emplace_back(work, t);
  work(0);
  for (auto& th : pool) th.join();
}

// Calls fn(i) for i in [0, n), as parallel_for_workers.
template <typename F>
void parallel_for(int64_t n, int threads, F&& fn, int64_t grain = 1) {
  parallel_for_workers(n, threads, [&](int, int64_t i) { fn(i); }, grain);
}

// Grain for chunks whose outputs are `bytes_per_item` apart in a huge-page-backed array: enough
// consecutive items to fill a 2 MiB page, so that threads first-touch (and the kernel zeroes)
// different pages instead of queueing on the same one, but no more than leaves every thread two
// runs.
inline int64_t page_grain(int64_t n, int threads, uint64_t bytes_per_item) {
  const uint64_t page = 1ull << 21;
  int64_t g = bytes_per_item >= page ? 1 : static_cast<int64_t>((page + bytes_per_item - 1) / bytes_per_item);
  const int64_t fair = (n + 2 * int64_t(threads) - 1) / (2 * int64_t(threads));
  if (g > fair) g = fair;
  return g < 1 ? 1 : g;
}

}  // namespace ep_comm::host
