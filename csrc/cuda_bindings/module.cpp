// ep_comm._cuda: pybind11 binding of the kernel launchers (csrc/cuda_bindings/launchers.h).
// Compiled by g++ without torch or CUDA headers: tensors arrive as data pointers (Python ints)
// in dicts keyed by the C++ field names, streams as raw cudaStream_t handles.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "../common/timeout.h"
#include "launchers.h"

namespace py = pybind11;
using namespace ep_comm::cuda;

namespace ep_comm::cuda {
void register_two_hop(py::module_& m);  // two_hop.cpp
void register_codecs(py::module_& m);   // codecs.cpp
}

namespace {

template <class T>
T* ptr(const py::dict& d, const char* key) {
  if (!d.contains(key)) throw std::invalid_argument(std::string("missing field: ") + key);
  py::object v = d[key];
  if (v.is_none()) return nullptr;
  return reinterpret_cast<T*>(v.cast<uintptr_t>());
}
template <class T>
T num(const py::dict& d, const char* key) {
  if (!d.contains(key)) throw std::invalid_argument(std::string("missing field: ") + key);
  return d[key].cast<T>();
}
void* stream_of(uintptr_t s) { return reinterpret_cast<void*>(s); }

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

// Raises RuntimeError when the launch (or anything before it on this thread) failed.
void check_launch(const char* what) {
  if (const char* error = take_launch_error()) throw std::runtime_error(std::string(what) + ": " + error);
}

void require_nvshmem() {
  if (!nvshmem_built()) throw std::runtime_error("ep_comm._cuda was built without NVSHMEM");
}

}  // namespace

PYBIND11_MODULE(_cuda, m) {
  m.doc() = "ep_comm CUDA kernels: layout, intranode (NVLink / virtual ranks), low-latency, internode";
  m.attr("max_ranks_per_launch") = kMaxRanks;
  m.attr("timeout_record_words") = static_cast<int>(ep_comm::kRecordWords);
  register_two_hop(m);
  register_codecs(m);
#if defined(EP_COMM_CUDA_ARCHS)
  m.attr("archs") = std::string(EP_COMM_CUDA_ARCHS);
  m.attr("nvshmem") = static_cast<bool>(EP_COMM_NVSHMEM);
  m.attr("nvshmem_reason") = std::string(EP_COMM_NVSHMEM_REASON);
#endif

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
    check_ranks(list.size());
    std::vector<DispatchRank> ranks;
    for (const auto& d : list) {
      DispatchRank r{};
      r.rank = num<int>(d, "rank");
      r.num_tokens = num<int>(d, "num_tokens");
      r.x = ptr<const uint8_t>(d, "x");
      r.x_scales = ptr<const float>(d, "x_scales");
      r.topk_idx = ptr<const int64_t>(d, "topk_idx");
      r.topk_weights = ptr<const float>(d, "topk_weights");
      r.is_token_in_rank = ptr<const bool>(d, "is_token_in_rank");
      r.meta = ptr<const int32_t>(d, "meta");
      r.recv_x = ptr<uint8_t>(d, "recv_x");
      r.recv_scales = ptr<float>(d, "recv_scales");
      r.recv_topk_idx = ptr<int64_t>(d, "recv_topk_idx");
      r.recv_topk_weights = ptr<float>(d, "recv_topk_weights");
      r.recv_src_idx = ptr<int32_t>(d, "recv_src_idx");
      r.record = ptr<int32_t>(d, "record");
      ranks.push_back(r);
    }
    launch_intranode_dispatch(intranode_common(common), ranks.data(), static_cast<int>(ranks.size()),
                              hidden_bytes, num_scales, threads, stream_of(stream));
    check_launch("intranode_dispatch");
  }, py::arg("common"), py::arg("ranks"), py::arg("hidden_bytes"), py::arg("num_scales"),
     py::arg("threads"), py::arg("stream"));

  m.def("intranode_combine", [](const py::dict& common, const std::vector<py::dict>& list,
                                int64_t hidden, int dtype, uintptr_t stream) {
    check_ranks(list.size());
    std::vector<CombineRank> ranks;
    for (const auto& d : list) {
      CombineRank r{};
      r.rank = num<int>(d, "rank");
      r.num_tokens = num<int>(d, "num_tokens");
      r.x = ptr<const uint8_t>(d, "x");
      r.topk_weights = ptr<const float>(d, "topk_weights");
      r.is_token_in_rank = ptr<const bool>(d, "is_token_in_rank");
      r.meta = ptr<const int32_t>(d, "meta");
      r.combined_x = ptr<uint8_t>(d, "combined_x");
      r.combined_topk_weights = ptr<float>(d, "combined_topk_weights");
      r.record = ptr<int32_t>(d, "record");
      ranks.push_back(r);
    }
    launch_intranode_combine(intranode_common(common), ranks.data(), static_cast<int>(ranks.size()),
                             hidden, dtype, stream_of(stream));
    check_launch("intranode_combine");
  }, py::arg("common"), py::arg("ranks"), py::arg("hidden"), py::arg("dtype"), py::arg("stream"));

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

  m.def("nvshmem_built", &nvshmem_built);
  m.def("nvshmem_unique_id", []() {
    require_nvshmem();
    std::string id(static_cast<size_t>(nvshmem_unique_id_size()), '\0');
    nvshmem_get_unique_id(reinterpret_cast<uint8_t*>(id.data()));
    return py::bytes(id);
  });
  m.def("nvshmem_init", [](const py::bytes& id, int rank, int num_ranks) {
    require_nvshmem();
    std::string s = id;
    if (static_cast<int>(s.size()) != nvshmem_unique_id_size()) throw std::invalid_argument("bad unique id size");
    nvshmem_init_with_unique_id(reinterpret_cast<const uint8_t*>(s.data()), rank, num_ranks);
  });
  m.def("nvshmem_finalize", []() { require_nvshmem(); nvshmem_finalize_pe(); });
  m.def("nvshmem_my_pe", []() { require_nvshmem(); return nvshmem_my_pe_id(); });
  m.def("nvshmem_n_pes", []() { require_nvshmem(); return nvshmem_num_pes(); });
  m.def("nvshmem_malloc", [](int64_t bytes) {
    require_nvshmem();
    void* p = nvshmem_alloc(bytes);
    if (!p) throw std::runtime_error("nvshmem_malloc failed (raise NVSHMEM_SYMMETRIC_SIZE)");
    return reinterpret_cast<uintptr_t>(p);
  });
  m.def("nvshmem_free", [](uintptr_t p) { require_nvshmem(); nvshmem_release(reinterpret_cast<void*>(p)); });
  m.def("nvshmem_ptr", [](uintptr_t p, int pe) {
    require_nvshmem();
    return reinterpret_cast<uintptr_t>(nvshmem_peer_ptr(reinterpret_cast<void*>(p), pe));
  });
  m.def("nvshmem_barrier_on_stream", [](uintptr_t s) { require_nvshmem(); nvshmem_barrier_on_stream(stream_of(s)); });
  // A barrier over PEs [0, num_pes) with a timeout (csrc/cuda/internode.cu bounded_barrier_kernel):
  // words = the symmetric u64[num_pes] region, value = this barrier's number (the same on every
  // PE, growing), record = the caller's TimeoutRecord (a PE that never arrives is recorded there).
  m.def("launch_bounded_barrier", [](uintptr_t words, int num_pes, int my_pe, unsigned long long value,
                                     unsigned long long timeout_ns, uintptr_t record, uintptr_t s) {
    require_nvshmem();
    if (num_pes < 1 || my_pe < 0 || my_pe >= num_pes)
      throw std::invalid_argument("launch_bounded_barrier: my_pe must be in [0, num_pes)");
    launch_bounded_barrier(reinterpret_cast<uint64_t*>(words), num_pes, my_pe, value, timeout_ns,
                           reinterpret_cast<int32_t*>(record), stream_of(s));
  }, py::arg("words"), py::arg("num_pes"), py::arg("my_pe"), py::arg("value"), py::arg("timeout_ns"),
     py::arg("record"), py::arg("stream"));
  m.def("exchange_round", [](const py::dict& d, uintptr_t stream) {
    require_nvshmem();
    launch_exchange_round(ptr<uint8_t>(d, "symmetric"), num<int64_t>(d, "slot_bytes"),
                          ptr<const uint8_t>(d, "send"), ptr<const int64_t>(d, "send_offsets"),
                          ptr<const int64_t>(d, "send_bytes"), ptr<uint8_t>(d, "recv"),
                          ptr<const int64_t>(d, "recv_offsets"), ptr<const int64_t>(d, "recv_bytes"),
                          num<int>(d, "num_ranks"), num<int>(d, "my_pe"),
                          num<unsigned long long>(d, "round_value"), num<unsigned long long>(d, "timeout_ns"),
                          ptr<int32_t>(d, "record"), stream_of(stream));
    check_launch("exchange_round");
  });
}
