// The grid of one emulated launch, or of several launched together on streams (csrc/emulation/
// cuda_runtime.h, GridLaunch): its blocks run as interleaved fibers on the calling OS thread, at
// most `resident` of a launch's blocks at once (the occupancy the launch would have on the
// emulated device, DeviceModel), admitted in block order (or the reverse) as earlier ones finish;
// a launch's blocks are admitted once its stream's earlier launches have finished. Every resident
// block advances one FiberBlock::step at a time, in turn, so a block that spins on a flag another
// resident block (or virtual rank, or launch on another stream) sets lets it be set. Each block
// has its own shared memory: the kernels' __shared__ variables live in one section of the library,
// which holds the running block's copy (swapped on every change of block).
//
// Schedule: a block whose thread has just published (a release store) waits until the other
// resident blocks can make no further progress or kPublishRounds rounds have passed, so a reader
// sees the flag before the publishing warp's other threads run (what a missing __syncwarp before a
// publish would allow on a GPU).
//
// ThreadSanitizer builds (fibers.h): the scheduler's own bookkeeping is not instrumented; the copies
// of shared memory between resident blocks are ordered only when one block is resident at a time
// (each block's start and end are synchronisation points), so race checks keep the default device.
//
// Stalls: when, with no block waiting on a publish, every thread of every resident block only
// repeats a failing spin-wait iteration for kIdleRounds rounds, nothing but the clock can change
// any more (the emulation is deterministic). The virtual clock then jumps past any timeout, so the
// bounded waits (csrc/common/device_sync.h) give up and record the timeout as on a GPU; with
// `stall_fails` the launch also fails, its `failure` saying which blocks spun and whether blocks of
// the grid were still waiting to become resident (a grid that cannot be co-resident). Threads that
// still only spin after the jump (a wait without a timeout) are a deadlock: the launch fails.
//
// External peers (ep_emu_set_external_peers, off by default): ranks in other processes share memory
// with this one (a test's stand-in for CUDA IPC), so a flag may still be set from outside the
// emulation. An idle grid then sleeps briefly in real time and resumes spinning instead of stalling,
// and falls back to the stall handling above only after `seconds` of real time without progress.
#pragma once

#include <chrono>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "fibers.h"

// Every __shared__ variable lives in this section (cuda_runtime.h's __shared__).
extern "C" char __start_ep_emu_shared[] __attribute__((weak, visibility("hidden")));
extern "C" char __stop_ep_emu_shared[] __attribute__((weak, visibility("hidden")));

namespace ep_emu {

struct BlockIndex {
  unsigned x = 0, y = 0, z = 0;
};

// The emulated device: `sms` multiprocessors, each holding up to `blocks_per_sm` blocks (fewer when
// the blocks are large: 2,048 threads and 32 blocks per SM at most, as on sm_90). resident_limit,
// when non-zero, caps the blocks resident at once below what the occupancy promises (as other work
// on the GPU would), so tests can run a grid that cannot be co-resident past the launch check.
struct DeviceModel {
  unsigned sms = 1, blocks_per_sm = 1, resident_limit = 0;
};

inline unsigned occupancy_per_sm(const DeviceModel& d, unsigned threads) {
  const unsigned warps = (threads + 31) / 32;
  unsigned n = warps == 0 ? 32 : 64 / warps;  // 64 warps (2,048 threads) per SM
  if (n > 32) n = 32;
  return n < d.blocks_per_sm ? n : d.blocks_per_sm;
}

inline unsigned resident_blocks(const DeviceModel& d, unsigned threads) {
  const unsigned n = d.sms * occupancy_per_sm(d, threads);
  return d.resident_limit != 0 && d.resident_limit < n ? d.resident_limit : n;
}

// One launch for GridRunner::run: a grid of `grid` blocks of `threads` threads running `body`, at
// most `resident` of its blocks at once, on `stream`. Launches on the same stream run one after
// the other, in the order given; launches on different streams run at the same time, each with its
// own `resident` (each stream stands for a device of its own, as each rank's stream is in a job of
// several processes).
struct GridLaunch {
  dim3 grid;
  unsigned threads = 0;
  size_t dynamic_bytes = 0;
  unsigned resident = 1;
  const void* stream = nullptr;
  std::function<void()> body;
};

// One resident block: its fibers, launch, index, shared memory (while another block runs) and
// dynamic shared memory.
struct ResidentBlock {
  FiberBlock fibers;
  unsigned launch = 0;
  BlockIndex index;
  dim3 block_dim, grid_dim;
  std::vector<char> shared;
  std::vector<uint64_t> dynamic;
  unsigned waiting_on_publish = 0;  // rounds the block still waits after a publish
  bool running = false;
};

// The block whose threads run now (blockIdx, blockDim, gridDim, dynamic shared memory).
inline thread_local ResidentBlock* tls_resident = nullptr;

// Seconds of real time an idle grid of this OS thread's later launches waits for another process to
// set a flag before it counts as stalled (0: no wait; ep_emu_set_external_peers).
inline thread_local double tls_external_peers_s = 0.0;

class GridRunner {
 public:
  static constexpr unsigned kIdleRounds = 4096;  // > 256: waits check for another's failure every 256 spins
  static constexpr unsigned long long kClockJumpNs = 1ULL << 50;  // 13 days: past any timeout
  // A block that published waits this many rounds, or until no other block progresses: a reader
  // spinning on the flag sees it before the publishing warp goes on, and a block that never waits
  // does not hold the publisher back until it has finished.
  static constexpr unsigned kPublishRounds = 16;
  static constexpr size_t kKeptBlocks = 4;  // resident blocks (with their fiber stacks) kept between runs
  // External peers: an idle grid sleeps this long before it spins another kIdleRounds rounds.
  static constexpr std::chrono::microseconds kExternalSleep{200};

  // Runs every launch of `launches` (GridLaunch: streams in parallel, each stream's launches in
  // order), each block of a launch admitted when its stream's earlier launches have finished and
  // fewer than its `resident` blocks are resident. Returns false (and why in `failure`) on a
  // deadlock at a barrier or between spinning blocks. `clock`: the virtual %globaltimer in ns
  // (jumps on a stall).
  EP_EMU_NO_TSAN bool run(const std::vector<GridLaunch>& launches, bool reverse, bool stall_fails,
                          unsigned long long& clock, std::string& failure) {
    const unsigned n = static_cast<unsigned>(launches.size());
    std::vector<Progress> progress(n);
    for (unsigned i = 0; i < n; ++i) {
      const GridLaunch& l = launches[i];
      progress[i].total = l.grid.x * l.grid.y * l.grid.z;
      const unsigned r = l.resident == 0 ? 1 : l.resident;
      progress[i].resident = r < progress[i].total ? r : progress[i].total;
      progress[i].done = progress[i].total == 0;
    }
    const size_t section = shared_section_bytes();
    std::vector<ResidentBlock*> slots;
    unsigned idle_rounds = 0;
    std::string stall;  // the first stall's description
    // external peers: when the grid went idle (only its first stall waits for them)
    bool idle_timed = false;
    std::chrono::steady_clock::time_point idle_since;
    auto wait_for_external_peers = [&] {
      if (tls_external_peers_s <= 0.0 || !stall.empty()) return false;
      const auto now = std::chrono::steady_clock::now();
      if (!idle_timed) {
        idle_timed = true;
        idle_since = now;
      }
      if (std::chrono::duration<double>(now - idle_since).count() >= tls_external_peers_s) return false;
      std::this_thread::sleep_for(kExternalSleep);
      return true;
    };
    holder_ = nullptr;
    // launch i may start: every earlier launch on its stream has finished
    auto ready = [&](unsigned i) {
      if (progress[i].done) return false;
      for (unsigned j = 0; j < i; ++j)
        if (launches[j].stream == launches[i].stream && !progress[j].done) return false;
      return true;
    };
    auto all_done = [&] {
      for (const Progress& p : progress)
        if (!p.done) return false;
      return true;
    };
    ResidentBlock* const outer = tls_resident;
    bool ok = true;
    while (ok && !all_done()) {
      bool progressed = false;
      for (unsigned o = 0; o < n; ++o) {
        const unsigned i = reverse ? n - 1 - o : o;
        if (!ready(i)) continue;
        const GridLaunch& l = launches[i];
        Progress& p = progress[i];
        while (p.live < p.resident && p.admitted < p.total) {
          ResidentBlock* b = free_block(slots);
          const unsigned linear = reverse ? p.total - 1 - p.admitted : p.admitted;
          b->launch = i;
          b->index = BlockIndex{linear % l.grid.x, linear / l.grid.x % l.grid.y, linear / (l.grid.x * l.grid.y)};
          b->block_dim = dim3(l.threads);
          b->grid_dim = l.grid;
          // shared memory is undefined when a block starts: 0x00 or 0xA5 bytes, alternating, so a
          // flag or count read before it is written is wrong one way or the other
          const int poison = (blocks_run_++ % 2) ? 0xA5 : 0x00;
          b->shared.assign(section, static_cast<char>(poison));
          b->dynamic.assign((l.dynamic_bytes + 7) / 8, 0);
          if (!b->dynamic.empty()) std::memset(b->dynamic.data(), poison, 8 * b->dynamic.size());
          b->waiting_on_publish = 0;
          b->running = true;
          enter(b, section);
          b->fibers.start(l.threads, l.body);
          slots.push_back(b);
          ++p.admitted;
          ++p.live;
          progressed = true;
        }
      }
      bool stepped = false;
      for (size_t i = 0; i < slots.size() && ok; ++i) {
        ResidentBlock* b = reverse ? slots[slots.size() - 1 - i] : slots[i];
        if (b->waiting_on_publish > 0) {
          --b->waiting_on_publish;
          continue;
        }
        stepped = true;
        enter(b, section);
        const FiberBlock::Step s = b->fibers.step(reverse);
        progressed |= s.progressed;
        b->waiting_on_publish = s.released ? kPublishRounds : 0;
        if (s.stuck) {
          failure = "deadlock in block " + name(b, n) +
                    ": its threads wait at barriers (__syncthreads / __syncwarp / a warp collective) that the "
                    "others of the block or warp never reach";
          ok = false;
        }
        if (s.finished) b->running = false;
      }
      for (size_t i = 0; i < slots.size();) {
        if (!slots[i]->running) {
          if (holder_ == slots[i]) holder_ = nullptr;
          Progress& p = progress[slots[i]->launch];
          --p.live;
          p.done = p.live == 0 && p.admitted == p.total;
          slots.erase(slots.begin() + static_cast<long>(i));
          progressed = true;
        } else {
          ++i;
        }
      }
      if (!ok) break;
      if (!progressed) {
        bool deferred = false;
        for (ResidentBlock* b : slots) deferred |= b->waiting_on_publish > 0;
        if (deferred || !stepped) {  // the others are quiet: the publishing blocks go on
          for (ResidentBlock* b : slots) b->waiting_on_publish = 0;
          continue;
        }
        if (++idle_rounds >= kIdleRounds) {
          idle_rounds = 0;
          if (wait_for_external_peers()) continue;
          if (!stall.empty()) {
            failure = stall + "; they still spun once every wait's timeout had passed";
            ok = false;
          } else {
            unsigned waiting = 0, total = 0, resident = 0;  // over the launches that may run
            for (unsigned i = 0; i < n; ++i) {
              if (!ready(i)) continue;
              waiting += progress[i].total - progress[i].admitted;
              total += progress[i].total;
              resident += progress[i].resident;
            }
            stall = stall_message(slots, n, waiting, total, resident);
            clock += kClockJumpNs;
          }
        }
      } else {
        idle_rounds = 0;
        idle_timed = false;
      }
    }
    if (ok && !stall.empty() && stall_fails) {
      failure = stall + "; their bounded waits then timed out";
      ok = false;
    }
    if (holder_ != nullptr) save(holder_, section);
    holder_ = nullptr;
    tls_resident = outer;
    // a few blocks' fiber stacks are kept for the next run; the rest are unmapped (each stack is
    // two mappings, and every emulated module in a process draws on vm.max_map_count)
    if (pool_.size() > kKeptBlocks) pool_.resize(kKeptBlocks);
    return ok;
  }

 private:
  static size_t shared_section_bytes() {
    char* const begin = __start_ep_emu_shared;  // null when no kernel declares shared memory
    char* const end = __stop_ep_emu_shared;
    return begin != nullptr && end > begin ? size_t(end - begin) : 0;
  }
  EP_EMU_NO_TSAN static void save(ResidentBlock* b, size_t section) {
    if (section) std::memcpy(b->shared.data(), __start_ep_emu_shared, section);
  }
  // Makes b the running block: its shared memory in the section, its index and dynamic memory.
  EP_EMU_NO_TSAN void enter(ResidentBlock* b, size_t section) {
    if (holder_ != b) {
      if (holder_ != nullptr && holder_->running) save(holder_, section);
      if (section) std::memcpy(__start_ep_emu_shared, b->shared.data(), section);
      holder_ = b;
    }
    tls_resident = b;
  }
  ResidentBlock* free_block(const std::vector<ResidentBlock*>& slots) {
    for (auto& b : pool_) {
      bool used = false;
      for (ResidentBlock* s : slots) used |= s == b.get();
      if (!used) return b.get();
    }
    pool_.emplace_back(new ResidentBlock());
    return pool_.back().get();
  }
  // A block's index, and its launch when several run together.
  static std::string name(const ResidentBlock* b, unsigned launches) {
    const BlockIndex& i = b->index;
    std::string m = "(" + std::to_string(i.x) + ", " + std::to_string(i.y) + ", " + std::to_string(i.z) + ")";
    return launches > 1 ? m + " of launch " + std::to_string(b->launch) : m;
  }
  static std::string stall_message(const std::vector<ResidentBlock*>& slots, unsigned launches,
                                   unsigned never_resident, unsigned total, unsigned resident) {
    std::string m = "stall: for " + std::to_string(kIdleRounds) +
                    " rounds every thread of the resident blocks spun on a flag without progress (blocks";
    for (size_t i = 0; i < slots.size() && i < 8; ++i) m += " " + name(slots[i], launches);
    if (slots.size() > 8) m += " and " + std::to_string(slots.size() - 8) + " more";
    m += ")";
    if (never_resident > 0)
      m += "; " + std::to_string(never_resident) + " of the grid's " + std::to_string(total) +
           " blocks were never resident (at most " + std::to_string(resident) +
           " at once): the grid needs more blocks co-resident than the device holds";
    else
      m += "; every block of the grid was resident: a flag they wait for is never released";
    return m;
  }
  struct Progress {  // of one launch
    unsigned total = 0, resident = 1, admitted = 0, live = 0;
    bool done = false;
  };

  std::vector<std::unique_ptr<ResidentBlock>> pool_;  // kept from run to run (fiber stacks)
  ResidentBlock* holder_ = nullptr;                    // whose shared memory is in the section
  uint64_t blocks_run_ = 0;                            // picks the next block's poison
};

}  // namespace ep_emu

// `seconds` > 0: ranks in other processes share memory with this OS thread's later launches (a
// stand-in for CUDA IPC), so an idle grid sleeps and spins again for up to `seconds` of real time
// before it counts as stalled; 0 (the default): an idle grid has stalled at once (grid.h).
extern "C" __attribute__((used, visibility("default"))) inline void ep_emu_set_external_peers(double seconds) {
  ep_emu::tls_external_peers_s = seconds > 0.0 ? seconds : 0.0;
}
