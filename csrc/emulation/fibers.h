// A thread block of the CUDA emulation (csrc/emulation/cuda_runtime.h) as fibers: every CUDA
// thread is a fiber with its own stack, all on the calling OS thread, switched only at the
// block's and warps' synchronisation points (__syncthreads, __syncwarp, the warp collectives), at
// each iteration of a spin-wait and after each release store. A FiberBlock advances step by step
// (step(): each runnable fiber once), so a launch interleaves the steps of its resident blocks
// (csrc/emulation/grid.h).
// So the kernels' CUDA source runs unchanged on the CPU, deterministically: a thread runs until
// it must wait for others, which is where the real hardware's threads could also be anywhere.
// A thread that reads shared memory another thread writes without a barrier between them sees
// the other thread's old value here (the other fiber has not run yet), so a missing __syncwarp
// shows up as a wrong result rather than a lucky one; a barrier that not every live thread of
// the block (or warp) reaches is reported as a deadlock (FiberBlock::run returns false).
// x86-64 (System V) only: the stack switch is six callee-saved registers, the stack pointer and a
// return, in assembly.
#pragma once
#if !defined(__x86_64__)
#error "the CUDA emulation's fibers switch stacks in x86-64 assembly"
#endif

#include <sys/mman.h>

#if defined(__SANITIZE_THREAD__)
#include <sanitizer/tsan_interface.h>
#endif

#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <new>
#include <vector>

namespace ep_emu {

// Saves the callee-saved registers on the current stack, stores the stack pointer to *save_sp,
// switches to load_sp and restores the registers saved there (by an earlier switch, or the frame
// FiberBlock::start_fiber lays out), returning into that context.
extern "C" __attribute__((naked, noinline)) inline void ep_emu_switch_stack(void** /*save_sp*/, void* /*load_sp*/) {
  asm volatile(
      "pushq %rbp\n\t"
      "pushq %rbx\n\t"
      "pushq %r12\n\t"
      "pushq %r13\n\t"
      "pushq %r14\n\t"
      "pushq %r15\n\t"
      "movq %rsp, (%rdi)\n\t"
      "movq %rsi, %rsp\n\t"
      "popq %r15\n\t"
      "popq %r14\n\t"
      "popq %r13\n\t"
      "popq %r12\n\t"
      "popq %rbx\n\t"
      "popq %rbp\n\t"
      "ret\n\t");
}

constexpr unsigned kWarpSize = 32;

// Under ThreadSanitizer (a build with -fsanitize=thread) every fiber is a TSan fiber, so TSan
// reports two CUDA threads of a block that touch the same memory (one of them writing) with no
// barrier between them: the barriers release before arriving and acquire after passing, the
// emulated atomics are atomic, and the scheduler's own bookkeeping is not instrumented (NO_TSAN).
// Race checks run one block at a time (grid.h), each block's start and end ordering it after the
// one before, so races between two blocks are not reported.
#if defined(__SANITIZE_THREAD__)
#define EP_EMU_NO_TSAN __attribute__((no_sanitize_thread, noinline))
inline void tsan_release(const void* sync) { __tsan_release(const_cast<void*>(sync)); }
inline void tsan_acquire(const void* sync) { __tsan_acquire(const_cast<void*>(sync)); }
#else
#define EP_EMU_NO_TSAN
inline void tsan_release(const void*) {}
inline void tsan_acquire(const void*) {}
#endif

class FiberBlock;
// The block whose fibers this OS thread is running (set by FiberBlock::run): how threadIdx and
// the collectives find their block. Per OS thread, so that two threads may each emulate a launch.
inline thread_local FiberBlock* tls_block = nullptr;

// A fiber's stack: its own mapping, with an inaccessible guard page below it, so that a stack
// overflow faults at once instead of overwriting another fiber's stack.
class FiberStack {
 public:
  static constexpr size_t kBytes = 64 << 10;
  static constexpr size_t kGuardBytes = 4096;
  FiberStack() {
    void* p = mmap(nullptr, kGuardBytes + kBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();
    mprotect(p, kGuardBytes, PROT_NONE);
    base_ = static_cast<char*>(p);
  }
  FiberStack(const FiberStack&) = delete;
  FiberStack& operator=(const FiberStack&) = delete;
  ~FiberStack() { munmap(base_, kGuardBytes + kBytes); }
  // One past the stack's highest byte (stacks grow down).
  char* top() const { return base_ + kGuardBytes + kBytes; }

 private:
  char* base_;
};

class FiberBlock {
 public:
  FiberBlock() = default;
  FiberBlock(const FiberBlock&) = delete;
  FiberBlock& operator=(const FiberBlock&) = delete;
  ~FiberBlock() {
#if defined(__SANITIZE_THREAD__)
    for (void* f : tsan_fibers_) __tsan_destroy_fiber(f);
#endif
  }

  // Starts `body` in each of `threads` fibers (thread indices 0 .. threads - 1); none runs until
  // step().
  EP_EMU_NO_TSAN void start(unsigned threads, const std::function<void()>& body) {
    while (stacks_.size() < threads) stacks_.emplace_back(new FiberStack());
    fibers_.assign(threads, Fiber{});
    warps_.assign((threads + kWarpSize - 1) / kWarpSize, Warp{});
    for (unsigned t = 0; t < threads; ++t) {
      Warp& w = warps_[t / kWarpSize];
      ++w.alive;
      w.alive_mask |= 1u << (t % kWarpSize);
    }
    alive_ = threads;
    block_arrived_ = 0;
    cursor_ = 0;
    body_ = &body;
    for (unsigned t = 0; t < threads; ++t) start_fiber(t);
    tsan_release(&tsan_start_);
  }

  // What one step() did. progressed: some fiber did more than fail one iteration of the spin-wait
  // it was already in (a spin iteration that ends in an acquire, a barrier, a publish, an exit all
  // count); released: the step stopped right after a fiber's release store (st_release_sys), the
  // fibers after it not yet resumed; finished: every fiber has returned; stuck: fibers are left
  // and all of them wait at barriers that the others cannot reach.
  struct Step {
    bool progressed = false, released = false, finished = false, stuck = false;
  };

  // Resumes each runnable fiber once, from thread 0 up (`reverse`: from the highest down), each
  // until it waits at a barrier, spins, publishes or returns; a pass cut short by a publish goes on
  // from the next fiber at the next step.
  EP_EMU_NO_TSAN Step step(bool reverse) {
    Step s;
    FiberBlock* outer = tls_block;
    tls_block = this;
#if defined(__SANITIZE_THREAD__)
    scheduler_tsan_ = __tsan_get_current_fiber();
#endif
    const unsigned n = static_cast<unsigned>(fibers_.size());
    bool resumed = false;
    for (; cursor_ < n && alive_ > 0; ++cursor_) {
      const unsigned t = reverse ? n - 1 - cursor_ : cursor_;
      Fiber& f = fibers_[t];
      if (f.done || (f.wait_gen != nullptr && *f.wait_gen == f.wait_value)) continue;
      f.wait_gen = nullptr;
      current_ = t;
      acquired_ = false;
      last_yield_ = YieldKind::kWait;
      to_fiber(f);
      resumed = true;
      const bool idle = f.spinning && last_yield_ == YieldKind::kSpin && !acquired_;
      f.spinning = last_yield_ == YieldKind::kSpin;
      s.progressed |= !idle;
      if (last_yield_ == YieldKind::kRelease) {
        s.released = true;
        ++cursor_;
        break;
      }
    }
    if (!s.released) cursor_ = 0;
    s.finished = alive_ == 0;
    if (s.finished) tsan_acquire(&tsan_end_);
    s.stuck = !s.finished && !resumed && !s.released && !any_runnable();
    tls_block = outer;
    return s;
  }

  // Runs the fibers started by start() until every one has returned: true, or false if they
  // deadlocked at barriers (the waiting fibers are then abandoned).
  EP_EMU_NO_TSAN bool run_to_end(bool reverse) {
    for (;;) {
      const Step s = step(reverse);
      if (s.finished) return true;
      if (s.stuck) return false;
    }
  }

  // start() and run_to_end() in one: `reverse` resumes the runnable fibers from the highest thread
  // index down, so that a thread reading what a lower thread writes without a barrier between
  // them runs first and reads the old value.
  EP_EMU_NO_TSAN bool run(unsigned threads, const std::function<void()>& body, bool reverse = false) {
    start(threads, body);
    return run_to_end(reverse);
  }

  EP_EMU_NO_TSAN unsigned thread_index() const { return current_; }
  EP_EMU_NO_TSAN unsigned lane() const { return current_ % kWarpSize; }

  // __syncthreads with the OR, AND and count of the live threads' `predicate`.
  struct BlockVote {
    int any, all, count;
  };
  EP_EMU_NO_TSAN BlockVote sync_block(int predicate) {
    vote_any_ |= predicate != 0;
    vote_all_ &= predicate != 0;
    vote_count_ += predicate != 0;
    // TSan: one sync object per barrier instance (by generation parity), or a thread arriving late
    // would acquire what a faster one released at the next barrier, after its later accesses
    const char* sync = &block_sync_[block_gen_ & 1];
    tsan_release(sync);
    if (++block_arrived_ == alive_) {
      release_block();
      yield();  // the others go on first, in the scheduler's order, as if this one had waited too
    } else {
      wait_while_unchanged(block_gen_);
    }
    tsan_acquire(sync);
    return result_;
  }

  // A warp collective: every live lane of the caller's warp passes `value` and gets the values of
  // all 32 lanes (exited lanes' as 0) and the mask of live lanes. Two barriers: the values are
  // all written before any lane reads them, and all read before any lane writes the next ones.
  struct WarpView {
    uint64_t values[kWarpSize];
    unsigned live;
  };
  EP_EMU_NO_TSAN WarpView warp_exchange(uint64_t value) {
    Warp& w = warps_[current_ / kWarpSize];
    w.slot[lane()] = value;
    warp_barrier(w);
    WarpView view;
    std::memcpy(view.values, w.slot, sizeof(view.values));
    view.live = w.alive_mask;
    for (unsigned l = 0; l < kWarpSize; ++l)
      if (!(view.live >> l & 1)) view.values[l] = 0;
    warp_barrier(w);
    return view;
  }
  EP_EMU_NO_TSAN void sync_warp() { warp_barrier(warps_[current_ / kWarpSize]); }
  // A spin-wait iteration: the calling thread stays runnable and the others of the block run
  // first (so a thread that waits for a flag another thread of the block sets lets it be set).
  EP_EMU_NO_TSAN void spin_yield() {
    last_yield_ = YieldKind::kSpin;
    to_scheduler(&fibers_[current_].sp);
  }
  // After a release store: back to the scheduler, which runs the other blocks before this one's
  // remaining threads (a missing __syncwarp before a publish then shows as a reader that sees the
  // flag before the rows).
  EP_EMU_NO_TSAN void release_yield() {
    last_yield_ = YieldKind::kRelease;
    to_scheduler(&fibers_[current_].sp);
  }
  // An acquire load by the running fiber: a spin-wait that ends in one made progress.
  EP_EMU_NO_TSAN void note_acquire() { acquired_ = true; }

 private:
  enum class YieldKind { kWait, kSpin, kRelease };
  struct Fiber {
    void* sp = nullptr;
    void* tsan = nullptr;  // its TSan fiber (TSan builds)
    bool done = false;
    bool spinning = false;  // its last resume ended in a spin-wait iteration
    const uint64_t* wait_gen = nullptr;  // runnable again once *wait_gen != wait_value
    uint64_t wait_value = 0;
  };
  struct Warp {
    uint64_t gen = 0;
    unsigned arrived = 0, alive = 0, alive_mask = 0;
    uint64_t slot[kWarpSize] = {};
    char sync[2] = {};  // TSan sync objects of even and odd barrier generations
  };

  // A fresh fiber's stack: the frame ep_emu_switch_stack pops (six registers, then the return
  // address fiber_main), with the stack 16-byte aligned as at a call when fiber_main starts.
  EP_EMU_NO_TSAN void start_fiber(unsigned t) {
    char* top = stacks_[t]->top();  // page-aligned, so 16-byte aligned
    void** sp = reinterpret_cast<void**>(top - 64);
    for (int k = 0; k < 6; ++k) sp[k] = nullptr;
    sp[6] = reinterpret_cast<void*>(&fiber_main);
    sp[7] = nullptr;  // fiber_main's (never used) return address
    fibers_[t].sp = sp;
#if defined(__SANITIZE_THREAD__)
    if (tsan_fibers_.size() <= t) tsan_fibers_.resize(t + 1, nullptr);
    if (tsan_fibers_[t] == nullptr) tsan_fibers_[t] = __tsan_create_fiber(0);  // kept, as the stacks are
    fibers_[t].tsan = tsan_fibers_[t];
#endif
  }

  EP_EMU_NO_TSAN static void fiber_main() {
    FiberBlock* b = tls_block;
    tsan_acquire(&b->tsan_start_);  // what the launching code did happens before this thread
    (*b->body_)();
    b->exit_current();
  }

  EP_EMU_NO_TSAN void exit_current() {
    Fiber& f = fibers_[current_];
    f.done = true;
    --alive_;
    Warp& w = warps_[current_ / kWarpSize];
    --w.alive;
    w.alive_mask &= ~(1u << lane());
    // the threads still running may be waiting for this one only
    if (block_arrived_ > 0 && block_arrived_ == alive_) release_block();
    if (w.arrived > 0 && w.arrived == w.alive) release_warp(w);
    tsan_release(&tsan_end_);  // what this thread did happens before what follows the block
    void* dead_sp;
    to_scheduler(&dead_sp);  // never resumed
    __builtin_unreachable();
  }

  // Back to the scheduler, runnable.
  EP_EMU_NO_TSAN void yield() { to_scheduler(&fibers_[current_].sp); }

  // Stack switches, announced to TSan first (without a happens-before edge: only barriers order
  // the CUDA threads).
  EP_EMU_NO_TSAN void to_scheduler(void** save_sp) {
#if defined(__SANITIZE_THREAD__)
    __tsan_switch_to_fiber(scheduler_tsan_, __tsan_switch_to_fiber_no_sync);
#endif
    ep_emu_switch_stack(save_sp, scheduler_sp_);
  }
  EP_EMU_NO_TSAN void to_fiber(Fiber& f) {
#if defined(__SANITIZE_THREAD__)
    __tsan_switch_to_fiber(f.tsan, __tsan_switch_to_fiber_no_sync);
#endif
    ep_emu_switch_stack(&scheduler_sp_, f.sp);
  }

  EP_EMU_NO_TSAN bool any_runnable() const {
    for (const Fiber& f : fibers_)
      if (!f.done && (f.wait_gen == nullptr || *f.wait_gen != f.wait_value)) return true;
    return false;
  }

  EP_EMU_NO_TSAN void wait_while_unchanged(const uint64_t& gen) {
    Fiber& f = fibers_[current_];
    f.wait_gen = &gen;
    f.wait_value = gen;
    to_scheduler(&f.sp);
  }

  EP_EMU_NO_TSAN void release_block() {
    result_ = BlockVote{vote_any_, vote_all_, vote_count_};
    vote_any_ = 0;
    vote_all_ = 1;
    vote_count_ = 0;
    block_arrived_ = 0;
    ++block_gen_;
  }

  EP_EMU_NO_TSAN void warp_barrier(Warp& w) {
    const char* sync = &w.sync[w.gen & 1];  // per barrier instance, as in sync_block
    tsan_release(sync);
    if (++w.arrived == w.alive) {
      release_warp(w);
      yield();
    } else {
      wait_while_unchanged(w.gen);
    }
    tsan_acquire(sync);
  }
  EP_EMU_NO_TSAN static void release_warp(Warp& w) {
    w.arrived = 0;
    ++w.gen;
  }

  std::vector<std::unique_ptr<FiberStack>> stacks_;
  std::vector<Fiber> fibers_;
  std::vector<Warp> warps_;
  void* scheduler_sp_ = nullptr;
  void* scheduler_tsan_ = nullptr;   // the scheduler's TSan fiber (TSan builds)
  std::vector<void*> tsan_fibers_;  // TSan fiber of each stack (TSan builds)
  char tsan_start_ = 0, tsan_end_ = 0;  // TSan sync objects: the launcher -> the threads -> the launcher
  unsigned current_ = 0, alive_ = 0, block_arrived_ = 0;
  unsigned cursor_ = 0;  // the next fiber (in the step's order) that step() resumes
  bool acquired_ = false;  // the running fiber made an acquire load since it was resumed
  YieldKind last_yield_ = YieldKind::kWait;
  uint64_t block_gen_ = 0;
  char block_sync_[2] = {};  // TSan sync objects of even and odd block barrier generations
  int vote_any_ = 0, vote_all_ = 1, vote_count_ = 0;
  BlockVote result_{};
  const std::function<void()>* body_ = nullptr;
};

}  // namespace ep_emu
