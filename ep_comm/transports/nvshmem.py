"""The NVSHMEM transport: a byte all-to-all with GPU-initiated NVSHMEM puts and signals
(``csrc/cuda/internode.cu``), bootstrapped from the user's ``torch.distributed`` group by
broadcasting the NVSHMEM unique id over it; NVSHMEM settings are passed explicitly
(``engines.runtime.NvshmemSettings``). The kernel engines that also run on NVSHMEM memory live in
``ep_comm.engines``.

Buffer byte layouts are defined once in ``csrc/common/buffer_layout.h``; sizes are read through
``ep_comm._host`` so Python and the kernels agree. Every kernel wait is bounded: a timeout is
recorded in a pinned host record and raised here as ``CommTimeoutError`` naming peer and phase.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..engines.runtime import (
    NvshmemSettings,
    TimeoutRecord,
    cuda_module,
    host_module,
    init_nvshmem,
    ptr_or_none,
    stream_handle,
)
from ..errors import CommTimeoutError
from .base import PendingExchange, Transport


class NvshmemTransport(Transport):
    """All-to-all of bytes through an NVSHMEM symmetric buffer (rounds of ``slot_bytes`` per peer).

    Large exchanges run as several rounds; each round is one put kernel, one bounded-wait kernel
    and a barrier on the stream (``csrc/cuda/internode.cu``).
    """

    name = "nvshmem"

    def __init__(self, group: dist.ProcessGroup, timeout_s: float, device: torch.device,
                 num_nvl_bytes: int = 0, num_rdma_bytes: int = 0, num_qps_per_rank: int = 24, *,
                 slot_bytes: int | None = None, settings: NvshmemSettings | None = None) -> None:
        """``num_rdma_bytes`` (DeepEP's meaning: the symmetric buffer), when given, sizes the
        per-peer round; ``num_qps_per_rank`` becomes NVSHMEM's IBGDA RC count per PE unless
        ``settings`` says otherwise. ``num_nvl_bytes`` is unused by this transport."""
        if not torch.cuda.is_available() or torch.device(device).type != "cuda":
            raise ValueError(f"backend='nvshmem' needs a CUDA device, got device={device} "
                             f"(CUDA available: {torch.cuda.is_available()})")
        super().__init__(dist.get_rank(group), dist.get_world_size(group), device)
        self.cuda = cuda_module()
        if slot_bytes is None:
            slot_bytes = max(num_rdma_bytes // max(self.num_ranks, 1), 1 << 20) if num_rdma_bytes else 16 << 20
        if settings is None:
            total = host_module().routing_exchange_layout(self.num_ranks, slot_bytes)[3]
            extra = {"NVSHMEM_IBGDA_NUM_RC_PER_PE": str(num_qps_per_rank)} if num_qps_per_rank > 0 else {}
            settings = NvshmemSettings(symmetric_size=max(1 << 30, 2 * total), extra=extra)
        pe, n = init_nvshmem(group, settings)
        if n != self.num_ranks:
            raise ValueError(f"NVSHMEM has {n} PEs but the group has {self.num_ranks} ranks")
        self.pe = pe
        _, _, self.slot_bytes, total = host_module().routing_exchange_layout(self.num_ranks, slot_bytes)
        self.symmetric = self.cuda.nvshmem_malloc(total)
        self.timeout_ns = int(timeout_s * 1e9)
        self.record = TimeoutRecord()
        self.round_value = 0

    @staticmethod
    def usable(group: dist.ProcessGroup) -> bool:
        """Whether ``backend="auto"`` may pick this transport for ``group``: the kernels were
        built with NVSHMEM and this process sees a CUDA device."""
        try:
            cuda = cuda_module()
        except RuntimeError:
            return False
        return bool(cuda.nvshmem_built()) and torch.cuda.is_available() and group is not None

    def close(self) -> None:
        if self.symmetric:
            self.cuda.nvshmem_free(self.symmetric)
            self.symmetric = 0

    def exchange_bytes(self, send: torch.Tensor, send_splits: list[int], recv_splits: list[int],
                       phase: str, out: torch.Tensor | None = None) -> PendingExchange:  # out: unused
        if send.dtype != torch.uint8 or send.dim() != 1:
            raise ValueError("transport payloads are 1-D uint8 tensors")
        send = send.to(self.device).contiguous()
        recv = torch.empty(sum(recv_splits), dtype=torch.uint8, device=self.device)
        self.num_collectives += 1
        rounds = max(1, -(-max([*send_splits, *recv_splits, 1]) // self.slot_bytes))
        send_start = torch.tensor([0, *send_splits], dtype=torch.int64).cumsum(0)[:-1]
        recv_start = torch.tensor([0, *recv_splits], dtype=torch.int64).cumsum(0)[:-1]
        s_len = torch.tensor(send_splits, dtype=torch.int64)
        r_len = torch.tensor(recv_splits, dtype=torch.int64)
        for i in range(rounds):
            lo = i * self.slot_bytes
            args = torch.stack([send_start + lo, (s_len - lo).clamp(0, self.slot_bytes),
                                recv_start + lo, (r_len - lo).clamp(0, self.slot_bytes)]).to(self.device)
            self.round_value += 1
            self.cuda.exchange_round({
                "symmetric": self.symmetric, "slot_bytes": self.slot_bytes, "send": ptr_or_none(send),
                "send_offsets": ptr_or_none(args[0]), "send_bytes": ptr_or_none(args[1]), "recv": ptr_or_none(recv),
                "recv_offsets": ptr_or_none(args[2]), "recv_bytes": ptr_or_none(args[3]),
                "num_ranks": self.num_ranks, "my_pe": self.pe, "round_value": self.round_value,
                "timeout_ns": self.timeout_ns, "record": self.record.ptr}, stream_handle(self.device))
            torch.cuda.current_stream(self.device).synchronize()
            self._check(phase)
        return PendingExchange(lambda: recv)

    def exchange_counts(self, counts: torch.Tensor, phase: str) -> torch.Tensor:
        if counts.dim() != 2 or counts.shape[0] != self.num_ranks:
            raise ValueError(f"counts must be [num_ranks, C], got {tuple(counts.shape)}")
        row = counts.shape[1] * 8
        send = counts.to(torch.int64).contiguous().view(torch.uint8).flatten()
        recv = self.exchange_bytes(send, [row] * self.num_ranks, [row] * self.num_ranks, phase).wait()
        return recv.view(torch.int64).view(self.num_ranks, -1).cpu()

    def _check(self, phase: str) -> None:
        try:
            self.record.check()
        except CommTimeoutError as error:
            raise CommTimeoutError(f"{error} during {phase}", peers=error.peers, phase=phase) from None


__all__ = ["NvshmemTransport"]
