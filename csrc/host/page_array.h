// NumPy arrays for the codec's large outputs, backed by their own anonymous mapping with
// transparent huge pages requested (madvise(MADV_HUGEPAGE), a hint that only concerns this
// mapping). Why: a fresh output of tens of MB is otherwise faulted in 4 KiB at a time on first
// touch, and those faults cost as much as decoding itself. Measured on the KVM guest this project
// runs on (map, touch, unmap; best of 200): 4 KiB faults 1.6-1.9 GB/s, huge pages 10-28 GB/s;
// lossless decode of real activations 0.9 GB/s into a fresh torch.empty output, 2.0 GB/s into a
// touched one, 1.5 GB/s into a huge-page one. Arrays below 2 MiB use NumPy's allocator: glibc
// often reuses freed heap memory for them, which costs nothing, and a huge page would round them
// up to 2 MiB.
//
// Freed mappings are kept for reuse (MappingCache, bounded), as glibc keeps freed heap memory:
// a mapping that is unmapped and mapped again is faulted in again on every call, and those faults
// are taken one at a time, so they also kept two decoding threads from going faster than one
// (measured: 2-thread decode of 3.7 MB activation tensors 1.2 GB/s into fresh mappings, 2.2 GB/s
// into touched memory; 1 thread 1.1 and 1.3). Arrays from 256 KiB to 2 MiB (64x7168 messages,
// the encoder's scratch) come from the cache too, with 4 KiB pages: in glibc's heap, other code's
// frees made glibc return them to the system, so that the codec faulted them in again (measured:
// 0 faults per repetition of the bench's steady loop alone, 487 in encode and 128 in decode right
// after zipnn's turn).
#pragma once
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <new>
#include <stdexcept>
#include <vector>
#ifdef __linux__
#include <pthread.h>
#include <sys/mman.h>
#endif

namespace ep_comm::host {

// Arrays at least this large get their own mapping, rounded up to whole huge pages (at most 2x
// the array's bytes); from kCachedArrayMinBytes, one rounded up to 4 KiB pages.
constexpr uint64_t kPageArrayMinBytes = 1ull << 21;
constexpr uint64_t kHugePageBytes = 1ull << 21;
constexpr uint64_t kCachedArrayMinBytes = 256ull << 10;
constexpr uint64_t kSmallPageBytes = 4096;

#ifdef __linux__
// The process's freed mappings of codec arrays and scratch, kept for the next ones: at most
// kMaxHeldBytes in kMaxEntries mappings (the oldest are unmapped first), each reused only for a
// request of at least half its bytes. Thread-safe; a fork while another thread holds the lock
// cannot leave the child's copy locked (pthread_atfork handlers take and release it around fork).
class MappingCache {
 public:
  static constexpr uint64_t kMaxHeldBytes = 256ull << 20;
  static constexpr size_t kMaxEntries = 256;

  // The process's cache (created on first use, never destroyed: arrays may be freed during
  // interpreter shutdown).
  static MappingCache& instance() {
    static MappingCache* cache = [] {
      auto* c = new MappingCache();
      pthread_atfork([] { instance().mutex_.lock(); }, [] { instance().mutex_.unlock(); },
                     [] { instance().mutex_.unlock(); });
      return c;
    }();
    return *cache;
  }

  // A mapping of at least `bytes` bytes (a multiple of 4 KiB): a cached one that fits, or a new
  // one (with huge pages requested from 2 MiB). Its size is written to `mapped`.
  void* take(uint64_t bytes, uint64_t& mapped) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      size_t best = entries_.size();
      for (size_t i = 0; i < entries_.size(); ++i) {
        const uint64_t size = entries_[i].bytes;
        if (size >= bytes && size / 2 <= bytes && (best == entries_.size() || size < entries_[best].bytes)) best = i;
      }
      if (best < entries_.size()) {
        const Entry e = entries_[best];
        entries_.erase(entries_.begin() + static_cast<std::ptrdiff_t>(best));
        held_ -= e.bytes;
        mapped = e.bytes;
        return e.base;
      }
    }
    void* base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base == MAP_FAILED) throw std::bad_alloc();
#ifdef MADV_HUGEPAGE
    if (bytes >= kPageArrayMinBytes) madvise(base, bytes, MADV_HUGEPAGE);  // a hint: failure is harmless
#endif
    mapped = bytes;
    return base;
  }

  // Takes back a mapping from take(): cached, or unmapped when it does not fit the bounds.
  void give(void* base, uint64_t bytes) {
    std::vector<Entry> evicted;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (bytes > kMaxHeldBytes) {
        evicted.push_back({base, bytes});
      } else {
        entries_.push_back({base, bytes});
        held_ += bytes;
        while (held_ > kMaxHeldBytes || entries_.size() > kMaxEntries) {
          evicted.push_back(entries_.front());
          held_ -= entries_.front().bytes;
          entries_.erase(entries_.begin());
        }
      }
    }
    for (const Entry& e : evicted) munmap(e.base, e.bytes);
  }

  // Unmaps every cached mapping.
  void clear() {
    std::vector<Entry> all;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      all.swap(entries_);
      held_ = 0;
    }
    for (const Entry& e : all) munmap(e.base, e.bytes);
  }

  // Bytes of the mappings held for reuse.
  uint64_t held_bytes() {
    std::lock_guard<std::mutex> lock(mutex_);
    return held_;
  }

 private:
  struct Entry {
    void* base;
    uint64_t bytes;
  };
  MappingCache() = default;
  std::mutex mutex_;
  std::vector<Entry> entries_;  // oldest first
  uint64_t held_ = 0;
};

#endif

// Scratch memory of at least `bytes` bytes (uninitialised) for one call: from the MappingCache
// from kCachedArrayMinBytes (given back when this is destroyed), else from the heap.
class ScratchBuffer {
 public:
  explicit ScratchBuffer(uint64_t bytes) {
#ifdef __linux__
    if (bytes >= kCachedArrayMinBytes) {
      data_ = static_cast<uint8_t*>(MappingCache::instance().take(round_up(bytes, kSmallPageBytes), mapped_));
      return;
    }
#endif
    heap_.reset(new uint8_t[bytes > 0 ? bytes : 1]);
    data_ = heap_.get();
  }
  ~ScratchBuffer() {
#ifdef __linux__
    if (mapped_ > 0) MappingCache::instance().give(data_, mapped_);
#endif
  }
  ScratchBuffer(const ScratchBuffer&) = delete;
  ScratchBuffer& operator=(const ScratchBuffer&) = delete;
  uint8_t* data() const { return data_; }
  static uint64_t round_up(uint64_t n, uint64_t unit) { return (n + unit - 1) / unit * unit; }

 private:
  uint8_t* data_ = nullptr;
  [[maybe_unused]] uint64_t mapped_ = 0;
  std::unique_ptr<uint8_t[]> heap_;
};
// A 1-D array of `count` items of T, uninitialised: from kCachedArrayMinBytes in a mapping of the
// MappingCache (given back when the array is freed), starting on a 2 MiB boundary from
// kPageArrayMinBytes; smaller ones from NumPy's allocator.
template <typename T>
pybind11::array_t<T> page_backed_array(uint64_t count) {
  if (count > (uint64_t(1) << 62) / sizeof(T)) throw std::invalid_argument("array too large");
  const uint64_t bytes = count * sizeof(T);
#ifdef __linux__
  if (bytes >= kCachedArrayMinBytes) {
    const bool huge = bytes >= kPageArrayMinBytes;
    // huge: whole huge pages, plus one more so that the array can start on a 2 MiB boundary
    const uint64_t want = huge ? ScratchBuffer::round_up(bytes, kHugePageBytes) + kHugePageBytes
                               : ScratchBuffer::round_up(bytes, kSmallPageBytes);
    uint64_t mapped = 0;
    void* base = MappingCache::instance().take(want, mapped);
    const uintptr_t start = huge ? (reinterpret_cast<uintptr_t>(base) + kHugePageBytes - 1) & ~uintptr_t(kHugePageBytes - 1)
                                 : reinterpret_cast<uintptr_t>(base);
    struct Mapping {
      void* base;
      uint64_t bytes;
    };
    auto* owner = new Mapping{base, mapped};
    pybind11::capsule free_when_done(owner, [](void* p) {
      auto* m = static_cast<Mapping*>(p);
      MappingCache::instance().give(m->base, m->bytes);
      delete m;
    });
    return pybind11::array_t<T>({static_cast<pybind11::ssize_t>(count)}, {static_cast<pybind11::ssize_t>(sizeof(T))},
                                reinterpret_cast<T*>(start), free_when_done);
  }
#endif
  return pybind11::array_t<T>(static_cast<pybind11::ssize_t>(count));
}

// Whether page_backed_array<T>(count) puts an array of `bytes` bytes on whole huge pages of its own.
inline bool is_page_backed(uint64_t bytes) {
#ifdef __linux__
  return bytes >= kPageArrayMinBytes;
#else
  (void)bytes;
  return false;
#endif
}

// Whether page_backed_array<T>(count) puts an array of `bytes` bytes in a mapping of its own
// (returned to the MappingCache when the array is freed).
inline bool has_own_mapping(uint64_t bytes) {
#ifdef __linux__
  return bytes >= kCachedArrayMinBytes;
#else
  (void)bytes;
  return false;
#endif
}

// Returns the whole huge pages of a page-backed array past its first `used` bytes to the system
// (the array stays valid; those pages read as zeros if touched again).
inline void release_unused_pages(void* array_start, uint64_t array_bytes, uint64_t used) {
#ifdef __linux__
  const uintptr_t start = reinterpret_cast<uintptr_t>(array_start);
  const uintptr_t begin = (start + used + kHugePageBytes - 1) & ~uintptr_t(kHugePageBytes - 1);
  const uintptr_t end = start + ((array_bytes + kHugePageBytes - 1) & ~(kHugePageBytes - 1));
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_DONTNEED);
#else
  (void)array_start;
  (void)array_bytes;
  (void)used;
#endif
}

}  // namespace ep_comm::host
