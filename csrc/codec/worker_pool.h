// The host codec's worker threads, kept from one call to the next. Starting and joining a thread
// for every call cost about 30 us on the 2-vCPU VMs this was measured on (create + join, C++ loop),
// a fifth of a 2-thread decode of a 64x7168 message. Pool threads wait for the next call by
// polling for up to kSpinMicros (calls in a stream come back to back), then block on a condition
// variable: no long spinning, since on a loaded host a spinning thread takes the core that working
// threads need (OpenMP's default spin-wait made 2 threads 10x slower than 1 on a loaded 2-core
// machine, measured with bench/codec_bench.py).
//
// One call uses the pool at a time (a concurrent call, from another Python thread, starts threads
// of its own instead). A forked child gets a pool of its own (a pthread_atfork child handler drops
// the parent's): it has none of its parent's threads, and the parent's pool mutexes may have been
// held at the fork. (A pid check would not do: a grandchild can be given the pid of a grandparent
// that used the pool.) Pool threads are detached and the pool is never destroyed, so nothing
// waits for them at exit.
#pragma once
#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <system_error>
#include <thread>

namespace ep_comm::host {

inline void spin_pause() {
#if defined(__x86_64__)
  __builtin_ia32_pause();
#endif
}

// Polls done() for up to `micros`; true once it holds.
template <typename F>
bool poll_for(int micros, F&& done) {
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::microseconds(micros);
  while (!done()) {
    for (int i = 0; i < 64; ++i) spin_pause();
    if (std::chrono::steady_clock::now() > give_up) return done();
  }
  return true;
}

class WorkerPool {
 public:
  static constexpr int kMaxThreads = 255;  // pool threads; a call asking for more runs on these
  static constexpr int kSpinMicros = 50;

  // This process's pool (created on first use, without threads).
  static WorkerPool& of_this_process() {
    static const bool fork_handler = [] {
      // in a forked child: forget the parent's pool (left as it is: its threads are not here)
      pthread_atfork(nullptr, nullptr, [] { current().store(nullptr, std::memory_order_relaxed); });
      return true;
    }();
    (void)fork_handler;
    WorkerPool* pool = current().load(std::memory_order_acquire);
    while (pool == nullptr) {
      WorkerPool* fresh = new WorkerPool();
      if (current().compare_exchange_strong(pool, fresh, std::memory_order_acq_rel)) return *fresh;
      delete fresh;  // another thread installed one: `pool` now holds it
    }
    return *pool;
  }

  // Held for the length of one call that uses the pool.
  std::mutex& call_mutex() { return call_; }

  // Starts pool threads until `wanted` (at most kMaxThreads) exist or one cannot be started;
  // returns how many exist. Call with call_mutex() held.
  int grow(int wanted) {
    wanted = std::min(wanted, kMaxThreads);
    while (size_ < wanted) {
      const int index = size_ + 1;
      const uint64_t seen = workers_[index].ticket.load(std::memory_order_relaxed);
      try {
        std::thread([this, index, seen] { serve(index, seen); }).detach();
      } catch (const std::system_error&) {
        break;
      }
      ++size_;
    }
    return size_;
  }

  // Runs job(w) for w in [1, workers] on pool threads (workers <= grow()'s result) and job(0) on
  // the calling thread; returns when all have returned. Only the pool threads taking part are
  // woken. Call with call_mutex() held. job must not throw.
  template <typename F>
  void run(int workers, F& job) {
    if (workers == 0) {
      job(0);
      return;
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      job_ = [](void* data, int worker) { (*static_cast<F*>(data))(worker); };
      job_data_ = &job;
      remaining_.store(workers, std::memory_order_relaxed);
      for (int w = 1; w <= workers; ++w)
        workers_[w].ticket.store(workers_[w].ticket.load(std::memory_order_relaxed) + 1, std::memory_order_release);
    }
    for (int w = 1; w <= workers; ++w) workers_[w].wake.notify_one();
    job(0);
    if (poll_for(kSpinMicros, [this] { return remaining_.load(std::memory_order_acquire) == 0; })) return;
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait(lock, [this] { return remaining_.load(std::memory_order_acquire) == 0; });
  }

 private:
  struct Worker {
    std::atomic<uint64_t> ticket{0};  // one more for each call this pool thread takes part in
    std::condition_variable wake;
  };

  WorkerPool() : workers_(new Worker[kMaxThreads + 1]) {}

  static std::atomic<WorkerPool*>& current() {
    static std::atomic<WorkerPool*> pool{nullptr};
    return pool;
  }

  // Pool thread `index` (>= 1): runs the job of each call that bumps its ticket, forever.
  void serve(int index, uint64_t seen) {
    Worker& me = workers_[index];
    for (;;) {
      poll_for(kSpinMicros, [&] { return me.ticket.load(std::memory_order_acquire) != seen; });
      std::unique_lock<std::mutex> lock(mutex_);
      me.wake.wait(lock, [&] { return me.ticket.load(std::memory_order_relaxed) != seen; });
      seen = me.ticket.load(std::memory_order_relaxed);
      void (*job)(void*, int) = job_;  // the call's job: unchanged until this thread is done with it
      void* data = job_data_;
      lock.unlock();
      job(data, index);
      if (remaining_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
        std::lock_guard<std::mutex> done_lock(mutex_);  // the caller is not between test and wait
        done_.notify_one();
      }
    }
  }

  std::mutex call_;
  std::mutex mutex_;  // guards job_, job_data_ and the tickets' changes; paired with the condition variables
  std::condition_variable done_;
  std::unique_ptr<Worker[]> workers_;  // [1, kMaxThreads]: pool thread i waits on workers_[i]
  void (*job_)(void*, int) = nullptr;
  void* job_data_ = nullptr;
  std::atomic<int> remaining_{0};  // pool threads of the current call not yet done
  int size_ = 0;                   // pool threads started (changed under call_)
};

}  // namespace ep_comm::host
