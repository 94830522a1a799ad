// The timeout record: a small int32 array in pinned, device-mapped host memory. A kernel whose
// bounded wait runs out fills it once (first writer wins) and every other wait loop of the launch
// sees status != 0 and gives up, so kernels end instead of hanging; Python reads it after the
// stream synchronises and raises ep_comm.CommTimeoutError naming the peer and the phase.
#pragma once
#include "hd.h"

namespace ep_comm {

// int32 word indices of the record.
enum TimeoutField : int {
  kStatus = 0,    // TimeoutStatus
  kRank = 1,      // rank (or virtual rank) that was waiting
  kPeer = 2,      // rank it was waiting for (-1: unknown)
  kPhase = 3,     // Phase code
  kWaitedMs = 4,  // how long it waited
  kDetail = 5,    // phase-specific detail (channel, local expert, expected value)
  kRecordWords = 8,
};

enum TimeoutStatus : int { kOk = 0, kTimedOut = 1, kCapacityOverflow = 2 };

enum Phase : int {
  kPhaseNone = 0,
  kIntranodeBarrier = 1,
  kIntranodeDispatchSend = 2,
  kIntranodeDispatchRecv = 3,
  kIntranodeCombineSend = 4,
  kIntranodeCombineRecv = 5,
  kLowLatencyDispatchRecv = 6,
  kLowLatencyCombineRecv = 7,
  kInternodeExchange = 8,
  kInternodeRailRecv = 9,  // two-hop dispatch: forwarder waits for a rail peer's rows
  kInternodeNodeRecv = 10, // two-hop dispatch: receiver waits for a forwarder of its node
  kInternodeCombineNodeRecv = 11,  // two-hop combine: forwarder waits for a rank of its node
  kInternodeCombineRailRecv = 12,  // two-hop combine: source waits for a node's forwarder
  kInternodeBarrier = 13,  // bounded NVSHMEM barrier ending an exchange round or a two-hop call
  kNumPhases = 14,
};

// Human-readable phase names; Python's CommTimeoutError.phase carries these strings.
inline const char* phase_name(int phase) {
  switch (phase) {
    case kIntranodeBarrier: return "intranode/barrier";
    case kIntranodeDispatchSend: return "intranode/dispatch-send";
    case kIntranodeDispatchRecv: return "intranode/dispatch-recv";
    case kIntranodeCombineSend: return "intranode/combine-send";
    case kIntranodeCombineRecv: return "intranode/combine-recv";
    case kLowLatencyDispatchRecv: return "low_latency/dispatch-recv";
    case kLowLatencyCombineRecv: return "low_latency/combine-recv";
    case kInternodeExchange: return "internode/exchange";
    case kInternodeRailRecv: return "internode/rail-recv";
    case kInternodeNodeRecv: return "internode/node-recv";
    case kInternodeCombineNodeRecv: return "internode/combine-node-recv";
    case kInternodeCombineRailRecv: return "internode/combine-rail-recv";
    case kInternodeBarrier: return "internode/barrier";
    default: return "none";
  }
}

// Host-side fill (the same record layout the kernels write); used by the CPU tests.
EP_HD void fill_record(int32_t* record, int status, int rank, int peer, int phase, int waited_ms,
                       int detail) {
  record[kRank] = rank;
  record[kPeer] = peer;
  record[kPhase] = phase;
  record[kWaitedMs] = waited_ms;
  record[kDetail] = detail;
  record[kStatus] = status;
}

}  // namespace ep_comm
