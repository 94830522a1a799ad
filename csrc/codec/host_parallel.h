// Host-only parallel loop for the codec bindings: items are claimed dynamically from an atomic
// counter by `threads` threads (the caller being one of them, the others from the process's
// WorkerPool). Threads that wait poll briefly, then block, so a busy or oversubscribed host does
// not lose the core that the working threads need.
#pragma once
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "codec/worker_pool.h"

namespace ep_comm::host {

inline int hardware_threads() {
  unsigned n = std::thread::hardware_concurrency();
  return n > 0 ? static_cast<int>(n) : 1;
}

// Calls fn(worker) once on each of up to `threads` threads (worker in [0, started); the calling
// thread is worker 0, the others are the process's pool threads, or, while another call holds the
// pool, threads started for this call and joined before it returns). When fewer threads can be
// had (a process limit, or more than WorkerPool::kMaxThreads asked for), on_fewer(started) runs
// before any fn call of the calling thread, so that a barrier sized for `threads` can be resized;
// work must therefore be claimed dynamically, not by worker index. Returns the number of workers.
// fn must not throw.
template <typename F, typename G>
int run_workers(int threads, F&& fn, G&& on_fewer) {
  if (threads > 1) {
    WorkerPool& pool = WorkerPool::of_this_process();
    std::unique_lock<std::mutex> lease(pool.call_mutex(), std::try_to_lock);
    if (lease.owns_lock()) {
      const int workers = std::min(pool.grow(threads - 1), threads - 1);
      if (workers + 1 < threads) on_fewer(workers + 1);
      pool.run(workers, fn);
      return workers + 1;
    }
  }
  std::vector<std::thread> pool;
  if (threads > 1) {
    pool.reserve(threads - 1);
    try {
      for (int t = 1; t < threads; ++t) pool.emplace_back([&fn, t] { fn(t); });
    } catch (const std::system_error&) {
      on_fewer(static_cast<int>(pool.size()) + 1);
    }
  }
  fn(0);
  for (auto& th : pool) th.join();
  return static_cast<int>(pool.size()) + 1;
}

template <typename F>
int run_workers(int threads, F&& fn) {
  return run_workers(threads, std::forward<F>(fn), [](int) {});
}

// Hands out the indices [0, n) in runs of `grain` consecutive indices, in increasing order, to
// whichever thread asks next.
class WorkCounter {
 public:
  WorkCounter(int64_t n, int64_t grain) : n_(n), grain_(grain < 1 ? 1 : grain) {}
  int64_t runs() const { return (n_ + grain_ - 1) / grain_; }
  // The next run [begin, end); false when none is left.
  bool claim(int64_t& begin, int64_t& end) {
    const int64_t r = next_.fetch_add(1, std::memory_order_relaxed);
    if (r >= runs()) return false;
    begin = r * grain_;
    end = std::min(n_, begin + grain_);
    return true;
  }

 private:
  std::atomic<int64_t> next_{0};
  const int64_t n_, grain_;
};

// One-use barrier of `count` threads: the last to arrive runs `completion`, then all return.
// A waiting thread first polls for up to kSpinMicros (the last thread's completion is short: the
// encoder's table build takes about 10 us, and a condition-variable wake alone cost about 14 us on
// a 2-vCPU VM), then blocks: no long spinning, since on a loaded 2-core host a spinning thread
// takes the core that the thread being waited for needs.
class BlockingBarrier {
 public:
  static constexpr int kSpinMicros = 50;

  explicit BlockingBarrier(int count) : left_(count) {}
  // Lowers the count from `count` to `fewer`: before the last of the `fewer` threads arrives.
  void expect(int count, int fewer) {
    std::lock_guard<std::mutex> lock(mutex_);
    left_ -= count - fewer;
  }
  template <typename F>
  void arrive_and_wait(F&& completion) {
    std::unique_lock<std::mutex> lock(mutex_);
    if (--left_ == 0) {
      completion();
      done_ = true;
      released_flag_.store(true, std::memory_order_release);
      lock.unlock();
      released_.notify_all();
      return;
    }
    lock.unlock();
    poll_for(kSpinMicros, [this] { return released_flag_.load(std::memory_order_acquire); });
    lock.lock();
    released_.wait(lock, [this] { return done_; });
  }

 private:
  std::mutex mutex_;
  std::condition_variable released_;
  std::atomic<bool> released_flag_{false};  // done_, readable without the mutex
  int left_;
  bool done_ = false;
};

// Calls fn(worker, i) for i in [0, n), on up to `threads` threads (worker in [0, threads): the
// calling thread is worker 0), which claim runs of `grain` consecutive indices in increasing
// order. fn must not throw.
template <typename F>
void parallel_for_workers(int64_t n, int threads, F&& fn, int64_t grain = 1) {
  WorkCounter work(n, grain);
  if (threads > work.runs()) threads = static_cast<int>(work.runs());
  run_workers(threads, [&](int worker) {
    for (int64_t begin, end; work.claim(begin, end);)
      for (int64_t i = begin; i < end; ++i) fn(worker, i);
  });
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
