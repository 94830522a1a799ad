"""Config with DeepEP's meaning: SM count and chunk sizes of the normal-mode kernels."""
from __future__ import annotations

from dataclasses import dataclass

NUM_MAX_NVL_PEERS = 8
METADATA_BYTES_PER_TOKEN = 512
"""Room per token for FP8 scales (up to 16 KiB hidden), top-k ids/weights (K <= 16), source index."""


@dataclass(frozen=True)
class Config:
    """Tuning of the normal-mode kernels (the portable backend accepts and ignores it).

    Attributes:
        num_sms: SMs the kernels use (an even number: senders and receivers pair up).
        num_max_nvl_chunked_send_tokens / num_max_nvl_chunked_recv_tokens: NVLink ring-buffer
            chunk and capacity, in tokens per channel.
        num_max_rdma_chunked_send_tokens / num_max_rdma_chunked_recv_tokens: the same for RDMA.
    """

    num_sms: int = 20
    num_max_nvl_chunked_send_tokens: int = 6
    num_max_nvl_chunked_recv_tokens: int = 256
    num_max_rdma_chunked_send_tokens: int = 6
    num_max_rdma_chunked_recv_tokens: int = 256

    def __post_init__(self) -> None:
        if self.num_sms <= 0 or self.num_sms % 2:
            raise ValueError(f"num_sms must be a positive even number, got {self.num_sms}")
        if not 0 < self.num_max_nvl_chunked_send_tokens < self.num_max_nvl_chunked_recv_tokens:
            raise ValueError("num_max_nvl_chunked_send_tokens must be positive and below "
                             "num_max_nvl_chunked_recv_tokens")
        if not 0 < self.num_max_rdma_chunked_send_tokens <= self.num_max_rdma_chunked_recv_tokens:
            raise ValueError("num_max_rdma_chunked_send_tokens must be positive and at most "
                             "num_max_rdma_chunked_recv_tokens")

    @property
    def num_channels(self) -> int:
        return self.num_sms // 2

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes of NVLink buffer this config needs for tokens of ``hidden_bytes`` bytes."""
        if hidden_bytes <= 0 or num_ranks <= 0:
            raise ValueError("hidden_bytes and num_ranks must be positive")
        nvl_ranks = min(num_ranks, NUM_MAX_NVL_PEERS)
        # one ring per (channel, sender, receiver): tokens plus head/tail words
        per_token = hidden_bytes + METADATA_BYTES_PER_TOKEN
        ring = self.num_max_nvl_chunked_recv_tokens * per_token + 64
        return _align(self.num_channels * nvl_ranks * nvl_ranks * ring, 128)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes of RDMA buffer this config needs; 0 within one node."""
        if hidden_bytes <= 0 or num_ranks <= 0:
            raise ValueError("hidden_bytes and num_ranks must be positive")
        if num_ranks <= NUM_MAX_NVL_PEERS:
            return 0
        rdma_ranks = num_ranks // NUM_MAX_NVL_PEERS
        per_token = hidden_bytes + METADATA_BYTES_PER_TOKEN
        ring = self.num_max_rdma_chunked_recv_tokens * per_token + 64
        return _align(self.num_channels * rdma_ranks * ring * 2, 128)


def _align(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


def default_dispatch_config(num_ranks: int) -> Config:
    """A dispatch config for ``num_ranks`` ranks (more ranks: smaller chunks, more buffering)."""
    if num_ranks <= 0:
        raise ValueError(f"num_ranks must be positive, got {num_ranks}")
    if num_ranks <= 8:
        return Config(20, 6, 256, 6, 128)
    return Config(20, 8, 288, 16, 128 if num_ranks <= 64 else 96)


def default_combine_config(num_ranks: int) -> Config:
    """A combine config for ``num_ranks`` ranks."""
    if num_ranks <= 0:
        raise ValueError(f"num_ranks must be positive, got {num_ranks}")
    if num_ranks <= 8:
        return Config(20, 6, 256, 6, 128)
    return Config(20, 4, 288, 12, 128 if num_ranks <= 64 else 96)
