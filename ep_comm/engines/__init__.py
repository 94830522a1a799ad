"""Python drivers of the compiled CUDA kernels (``ep_comm._cuda``): each engine owns its device
buffers and launches one job's kernels (intranode, low-latency, two-hop), and ``runtime`` holds
what they share (the compiled modules, NVSHMEM start-up, the pinned timeout record)."""
from .intranode import IntranodeEngine, IntranodeHandle, PeerBuffers
from .low_latency import LowLatencyEngine, LowLatencyLaunch, LowLatencyResult
from .runtime import NvshmemSettings, TimeoutRecord, available, init_nvshmem
from .two_hop import MAX_NODE_RANKS, TwoHopDispatchResult, TwoHopEngine, TwoHopHandle, TwoHopRows, two_hop_arrays

__all__ = [
    "MAX_NODE_RANKS", "IntranodeEngine", "IntranodeHandle", "LowLatencyEngine", "LowLatencyLaunch",
    "LowLatencyResult", "NvshmemSettings", "PeerBuffers", "TimeoutRecord", "TwoHopDispatchResult",
    "TwoHopEngine", "TwoHopHandle", "TwoHopRows", "available", "init_nvshmem", "two_hop_arrays",
]
