// pybind11 bindings of the kernels that move rows between peer buffers addressed by load/store
// (csrc/cuda/layout.cu, intranode.cu, low_latency.cu): one `common` dict and one dict per virtual
// rank (binding_args.h). Part of ep_comm._cuda (module.cpp); the CPU tests build the same bindings
// over the emulated kernels (tests/support/emulated_cuda.py).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "../common/buffer_layout.h"
#include "binding_args.h"
#include "launchers.h"

namespace py = pybind11;

namespace ep_comm::cuda {
namespace {

using bindings::check_launch;
using bindings::num;
using bindings::ptr;
using bindings::stream_of;

void check_ranks(size_t n) {
  if (n == 0 || n > static_cast<size_t>(kMaxRanks))
    throw std::invalid_argument("between 1 and " + std::to_string(kMaxRanks) + " ranks per launch");
}

IntranodeCommon intranode_common(const py::dict& d) {
  IntranodeCommon c{};
  auto peers = d["peers"].cast<std::vector<uintptr_t>>();
  if (peers.size() > static_cast<size_t>(kMaxRanks)) throw std::invalid_argument("at most 8 peers");
  for (size_t i = 0; i < peers.size(); ++i) c.peers[i] = reinterpret_cast<uint8_t*>(peers[i]);
  c.expert_to_rank = ptr<const int32_t>(d, "expert_to_rank");
  c.expert_to_local = ptr<const int32_t>(d, "expert_to_local");
  c.num_ranks = num<int>(d, "num_ranks");
  c.num_channels = num<int>(d, "num_channels");
  c.max_local_experts = num<int>(d, "max_local_experts");
  c.num_experts = num<int>(d, "num_experts");
  c.num_topk = num<int>(d, "num_topk");
  c.ring_slots = num<int64_t>(d, "ring_slots");
  c.row_bytes = num<int64_t>(d, "row_bytes");
  c.timeout_ns = num<unsigned long long>(d, "timeout_ns");
  c.barrier_value = num<int>(d, "barrier_value");
  c.warps_per_peer = d.contains("warps_per_peer") ? num<int>(d, "warps_per_peer") : 1;
  if (c.warps_per_peer < 1 || c.warps_per_peer > kMaxWarpsPerPeer)
    throw std::invalid_argument("warps_per_peer must be 1 to " + std::to_string(kMaxWarpsPerPeer));
  if (static_cast<int>(peers.size()) != c.num_ranks) throw std::invalid_argument("peers must list every rank");
  return c;
}

LowLatencyCommon low_latency_common(const py::dict& d) {
  LowLatencyCommon c{};
  auto peers = d["peers"].cast<std::vector<uintptr_t>>();
  if (peers.size() > static_cast<size_t>(kMaxRanks)) throw std::invalid_argument("at most 8 peers");
  for (size_t i = 0; i < peers.size(); ++i) c.peers[i] = reinterpret_cast<uint8_t*>(peers[i]);
  c.symmetric_base = ptr<uint8_t>(d, "symmetric_base");
  c.expert_to_rank = ptr<const int32_t>(d, "expert_to_rank");
  c.expert_to_local = ptr<const int32_t>(d, "expert_to_local");
  c.num_ranks = num<int>(d, "num_ranks");
  c.num_experts = num<int>(d, "num_experts");
  c.max_local_experts = num<int>(d, "max_local_experts");
  c.num_topk = num<int>(d, "num_topk");
  c.max_tokens = num<int>(d, "max_tokens");
  c.hidden = num<int64_t>(d, "hidden");
  c.timeout_ns = num<unsigned long long>(d, "timeout_ns");
  return c;
}

std::vector<LowLatencyRank> low_latency_ranks(const std::vector<py::dict>& list) {
  check_ranks(list.size());
  std::vector<LowLatencyRank> out;
  for (const auto& d : list) {
    LowLatencyRank r{};
    r.rank = num<int>(d, "rank");
    r.num_tokens = num<int>(d, "num_tokens");
    r.num_local_experts = num<int>(d, "num_local_experts");
    r.x = ptr<const uint16_t>(d, "x");
    r.topk_idx = ptr<const int64_t>(d, "topk_idx");
    r.topk_weights = ptr<const float>(d, "topk_weights");
    r.recv_x = ptr<uint8_t>(d, "recv_x");
    r.recv_scales = ptr<float>(d, "recv_scales");
    r.recv_count = ptr<int32_t>(d, "recv_count");
    r.recv_src_info = ptr<int32_t>(d, "recv_src_info");
    r.recv_topk_slot = ptr<int32_t>(d, "recv_topk_slot");
    r.layout_range = ptr<int64_t>(d, "layout_range");
    r.combined_x = ptr<uint16_t>(d, "combined_x");
    r.record = ptr<int32_t>(d, "record");
    out.push_back(r);
  }
  return out;
}

// The entries [local_begin, local_end) of a launch run on this process and hold every field; the
// others (a direct launch's remote ranks) hold only what the kernels read from another rank: "rank",
// "meta" and the "recv_*" outputs of a dispatch; "rank", "meta", "x" and "topk_weights" of a combine.
struct LocalEntries {
  size_t begin = 0, end = SIZE_MAX;
  bool local(size_t i) const { return i >= begin && i < end; }
};

// The direct launchers' local range from the bindings' (local_begin, num_local); num_local < 0: every
// entry from local_begin on.
LocalEntries local_entries(size_t n, int local_begin, int num_local) {
  if (local_begin < 0 || static_cast<size_t>(local_begin) >= n)
    throw std::invalid_argument("local_begin " + std::to_string(local_begin) + " is not an entry of the " +
                                std::to_string(n) + " ranks");
  const size_t count = num_local < 0 ? n - local_begin : static_cast<size_t>(num_local);
  if (count == 0 || local_begin + count > n)
    throw std::invalid_argument("num_local " + std::to_string(num_local) + " from local_begin " +
                                std::to_string(local_begin) + " is not within the " + std::to_string(n) + " ranks");
  return LocalEntries{static_cast<size_t>(local_begin), local_begin + count};
}

std::vector<DispatchRank> dispatch_ranks(const std::vector<py::dict>& list, LocalEntries locals = {}) {
  check_ranks(list.size());
  std::vector<DispatchRank> ranks;
  for (size_t i = 0; i < list.size(); ++i) {
    const py::dict& d = list[i];
    DispatchRank r{};
    r.rank = num<int>(d, "rank");
    r.meta = ptr<const int32_t>(d, "meta");
    r.recv_x = ptr<uint8_t>(d, "recv_x");
    r.recv_scales = ptr<float>(d, "recv_scales");
    r.recv_topk_idx = ptr<int64_t>(d, "recv_topk_idx");
    r.recv_topk_weights = ptr<float>(d, "recv_topk_weights");
    r.recv_src_idx = ptr<int32_t>(d, "recv_src_idx");
    if (!locals.local(i)) {
      ranks.push_back(r);
      continue;
    }
    r.num_tokens = num<int>(d, "num_tokens");
    r.x = ptr<const uint8_t>(d, "x");
    r.x_scales = ptr<const float>(d, "x_scales");
    r.topk_idx = ptr<const int64_t>(d, "topk_idx");
    r.topk_weights = ptr<const float>(d, "topk_weights");
    r.is_token_in_rank = ptr<const bool>(d, "is_token_in_rank");
    r.record = ptr<int32_t>(d, "record");
    ranks.push_back(r);
  }
  return ranks;
}

std::vector<CombineRank> combine_ranks(const std::vector<py::dict>& list, LocalEntries locals = {}) {
  check_ranks(list.size());
  std::vector<CombineRank> ranks;
  for (size_t i = 0; i < list.size(); ++i) {
    const py::dict& d = list[i];
    CombineRank r{};
    r.rank = num<int>(d, "rank");
    r.x = ptr<const uint8_t>(d, "x");
    r.topk_weights = ptr<const float>(d, "topk_weights");
    r.meta = ptr<const int32_t>(d, "meta");
    if (!locals.local(i)) {
      ranks.push_back(r);
      continue;
    }
    r.num_tokens = num<int>(d, "num_tokens");
    r.is_token_in_rank = ptr<const bool>(d, "is_token_in_rank");
    r.combined_x = ptr<uint8_t>(d, "combined_x");
    r.combined_topk_weights = ptr<float>(d, "combined_topk_weights");
    r.record = ptr<int32_t>(d, "record");
    ranks.push_back(r);
  }
  return ranks;
}

}  // namespace

void register_peer_kernels(py::module_& m) {
  m.def("dispatch_layout", [](const py::dict& d, uintptr_t stream) {
    LayoutArgs a{};
    a.topk_idx = ptr<const int64_t>(d, "topk_idx");
    a.expert_to_rank = ptr<const int32_t>(d, "expert_to_rank");
    a.num_tokens = num<int>(d, "num_tokens");
    a.num_topk = num<int>(d, "num_topk");
    a.num_experts = num<int>(d, "num_experts");
    a.num_ranks = num<int>(d, "num_ranks");
    a.ranks_per_node = num<int>(d, "ranks_per_node");
    a.num_tokens_per_rank = ptr<int32_t>(d, "num_tokens_per_rank");
    a.num_tokens_per_rdma_rank = ptr<int32_t>(d, "num_tokens_per_rdma_rank");
    a.num_tokens_per_expert = ptr<int32_t>(d, "num_tokens_per_expert");
    a.is_token_in_rank = ptr<bool>(d, "is_token_in_rank");
    launch_dispatch_layout(a, stream_of(stream));
    check_launch("dispatch_layout");
  }, py::arg("args"), py::arg("stream"), "Dispatch layout of one rank's topk_idx (layout.py).");

  m.def("intranode_meta_words", &meta_words, py::arg("num_ranks"), py::arg("num_channels"),
        py::arg("max_local_experts"));

  m.def("intranode_notify", [](const py::dict& common, const std::vector<py::dict>& list, uintptr_t stream) {
    check_ranks(list.size());
    std::vector<NotifyRank> ranks;
    for (const auto& d : list) {
      NotifyRank r{};
      r.rank = num<int>(d, "rank");
      r.num_tokens = num<int>(d, "num_tokens");
      r.is_token_in_rank = ptr<const bool>(d, "is_token_in_rank");
      r.num_tokens_per_expert = ptr<const int32_t>(d, "num_tokens_per_expert");
      r.meta = ptr<int32_t>(d, "meta");
      r.record = ptr<int32_t>(d, "record");
      ranks.push_back(r);
    }
    launch_intranode_notify(intranode_common(common), ranks.data(), static_cast<int>(ranks.size()),
                            stream_of(stream));
    check_launch("intranode_notify");
  }, py::arg("common"), py::arg("ranks"), py::arg("stream"));

  m.def("intranode_dispatch", [](const py::dict& common, const std::vector<py::dict>& list,
                                 int64_t hidden_bytes, int num_scales, int threads, uintptr_t stream) {
    auto ranks = dispatch_ranks(list);
    launch_intranode_dispatch(intranode_common(common), ranks.data(), static_cast<int>(ranks.size()),
                              hidden_bytes, num_scales, threads, stream_of(stream));
    check_launch("intranode_dispatch");
  }, py::arg("common"), py::arg("ranks"), py::arg("hidden_bytes"), py::arg("num_scales"),
     py::arg("threads"), py::arg("stream"));

  m.def("intranode_dispatch_direct", [](const py::dict& common, const std::vector<py::dict>& list,
                                        int64_t hidden_bytes, int num_scales, int threads, uintptr_t stream,
                                        int local_begin, int num_local) {
    const LocalEntries locals = local_entries(list.size(), local_begin, num_local);
    auto ranks = dispatch_ranks(list, locals);
    launch_intranode_dispatch_direct(intranode_common(common), ranks.data(), static_cast<int>(ranks.size()),
                                     static_cast<int>(locals.begin), static_cast<int>(locals.end - locals.begin),
                                     hidden_bytes, num_scales, threads, stream_of(stream));
    check_launch("intranode_dispatch_direct");
  }, py::arg("common"), py::arg("ranks"), py::arg("hidden_bytes"), py::arg("num_scales"),
     py::arg("threads"), py::arg("stream"), py::arg("local_begin") = 0, py::arg("num_local") = -1,
     "intranode_dispatch writing rows straight into the receivers' outputs. `ranks` holds every rank's "
     "entry; the launch runs entries [local_begin, local_begin + num_local) (num_local -1: to the end), the "
     "others need only rank, meta and the recv_* outputs.");

  m.def("intranode_combine", [](const py::dict& common, const std::vector<py::dict>& list,
                                int64_t hidden, int dtype, uintptr_t stream) {
    auto ranks = combine_ranks(list);
    launch_intranode_combine(intranode_common(common), ranks.data(), static_cast<int>(ranks.size()),
                             hidden, dtype, stream_of(stream));
    check_launch("intranode_combine");
  }, py::arg("common"), py::arg("ranks"), py::arg("hidden"), py::arg("dtype"), py::arg("stream"));

  m.def("intranode_combine_direct", [](const py::dict& common, const std::vector<py::dict>& list,
                                       int64_t hidden, int dtype, uintptr_t stream, int local_begin, int num_local) {
    const LocalEntries locals = local_entries(list.size(), local_begin, num_local);
    auto ranks = combine_ranks(list, locals);
    launch_intranode_combine_direct(intranode_common(common), ranks.data(), static_cast<int>(ranks.size()),
                                    static_cast<int>(locals.begin), static_cast<int>(locals.end - locals.begin),
                                    hidden, dtype, stream_of(stream));
    check_launch("intranode_combine_direct");
  }, py::arg("common"), py::arg("ranks"), py::arg("hidden"), py::arg("dtype"), py::arg("stream"),
     py::arg("local_begin") = 0, py::arg("num_local") = -1,
     "intranode_combine reading each returned row from its sender's x. `ranks` holds every rank's entry; the "
     "launch runs entries [local_begin, local_begin + num_local), the others need only rank, meta, x and "
     "topk_weights.");

  auto flags = [](bool fp8, bool round_scale, bool ue8m0) { return LowLatencyFlags{fp8, round_scale, ue8m0}; };
  m.def("low_latency_dispatch_send", [flags](const py::dict& common, const std::vector<py::dict>& list,
                                             bool use_fp8, bool round_scale, bool use_ue8m0, uintptr_t stream) {
    auto ranks = low_latency_ranks(list);
    launch_low_latency_dispatch_send(low_latency_common(common), ranks.data(), static_cast<int>(ranks.size()),
                                     flags(use_fp8, round_scale, use_ue8m0), stream_of(stream));
    check_launch("low_latency_dispatch_send");
  });
  m.def("low_latency_dispatch_recv", [flags](const py::dict& common, const std::vector<py::dict>& list,
                                             bool use_fp8, bool round_scale, bool use_ue8m0, uintptr_t stream) {
    auto ranks = low_latency_ranks(list);
    launch_low_latency_dispatch_recv(low_latency_common(common), ranks.data(), static_cast<int>(ranks.size()),
                                     flags(use_fp8, round_scale, use_ue8m0), stream_of(stream));
    check_launch("low_latency_dispatch_recv");
  });
  m.def("low_latency_combine_send", [](const py::dict& common, const std::vector<py::dict>& list, uintptr_t stream) {
    auto ranks = low_latency_ranks(list);
    launch_low_latency_combine_send(low_latency_common(common), ranks.data(), static_cast<int>(ranks.size()),
                                    stream_of(stream));
    check_launch("low_latency_combine_send");
  });
  m.def("low_latency_combine_recv", [](const py::dict& common, const std::vector<py::dict>& list, uintptr_t stream) {
    auto ranks = low_latency_ranks(list);
    launch_low_latency_combine_recv(low_latency_common(common), ranks.data(), static_cast<int>(ranks.size()),
                                    stream_of(stream));
    check_launch("low_latency_combine_recv");
  });

}

}  // namespace ep_comm::cuda
