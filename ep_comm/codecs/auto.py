"""``codec="auto"``: compress only when it pays.

Sending ``B`` raw bytes over a link of bandwidth ``L`` takes ``B / L``. Compressing them to
``rho * B`` costs ``B / enc + B / dec`` of codec time (encode on the sender, decode on the
receiver, not overlapped with the transfer on this path), so lossless compression pays when::

    B / L  >  rho * B / L + B / enc + B / dec      <=>      (1 - rho) / L  >  1 / enc + 1 / dec

``rho`` is the compression ratio observed on this buffer's earlier lossless messages (0.7 before
any); ``enc`` and ``dec`` are the codec's throughputs where it runs for the payload (its GPU when
the CUDA codec kernels are built for it, else the CPU), measured once per policy and place on a
1 MiB bf16 sample unless configured; ``L`` is the link bandwidth, configured per Buffer (the defaults below
are typical figures for each transport, not measurements). Lossy FP8 is never chosen by ``auto``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

DEFAULT_LINK_GBPS = {"gloo": 2.0, "nccl": 50.0, "rccl": 50.0, "nvshmem": 50.0}
"""Per-transport default link bandwidth in GB/s: TCP on one host; 400 Gb/s RDMA between nodes."""


@dataclass
class AutoCodecPolicy:
    """Inputs of the rule in this module's docstring.

    Attributes:
        link_gbps: link bandwidth ``L`` (GB/s); None = the transport's default.
        encode_gbps / decode_gbps: codec throughputs (GB/s); None = measure once.
        expected_ratio: ``rho`` until a lossless message has been sent.
        observed_ratio: updated from every lossless message (an exponential average).
    """

    link_gbps: float | None = None
    encode_gbps: float | None = None
    decode_gbps: float | None = None
    expected_ratio: float = 0.7
    observed_ratio: float | None = None
    _measured: dict[str, dict[str, float]] = field(default_factory=dict, repr=False)

    def ratio(self) -> float:
        return self.observed_ratio if self.observed_ratio is not None else self.expected_ratio

    def observe(self, raw_bytes: int, wire_bytes: int) -> None:
        """Folds one lossless message's ``wire / raw`` into the running ratio."""
        if raw_bytes <= 0:
            return
        r = wire_bytes / raw_bytes
        self.observed_ratio = r if self.observed_ratio is None else 0.8 * self.observed_ratio + 0.2 * r

    def throughputs(self, device: torch.device | str = "cpu") -> tuple[float, float]:
        """``(encode, decode)`` GB/s: configured, else measured once per place the codec runs for
        payloads on ``device`` (its GPU when the CUDA codec kernels are built for it, else the
        CPU), on a 1 MiB sample."""
        if self.encode_gbps is not None and self.decode_gbps is not None:
            return self.encode_gbps, self.decode_gbps
        from . import lossless, lossless_device

        try:
            device = torch.device(device)
        except (TypeError, RuntimeError) as error:
            raise ValueError(f"device must be a torch.device or a device string, got {device!r}") from error
        where = device if lossless_device.available(device) else torch.device("cpu")
        key = str(where)
        if key not in self._measured:
            sample = (torch.randn(512, 1024) * 0.05).to(torch.bfloat16).to(where)
            # chunks and threads as the transport codes messages
            chunk_values, threads = lossless.message_chunk_values(where), lossless.message_threads()
            lossless.decode(lossless.encode(sample, chunk_values=chunk_values, threads=threads),
                            threads=threads)  # warm up (synchronised)
            start = time.perf_counter()
            blob = lossless.encode(sample, chunk_values=chunk_values, threads=threads)
            middle = time.perf_counter()
            lossless.decode(blob, threads=threads)
            end = time.perf_counter()
            nbytes = sample.numel() * 2
            self._measured[key] = {"encode": nbytes / max(middle - start, 1e-9) / 1e9,
                                   "decode": nbytes / max(end - middle, 1e-9) / 1e9}
        measured = self._measured[key]
        return (self.encode_gbps or measured["encode"], self.decode_gbps or measured["decode"])

    def pays(self, transport_kind: str, device: torch.device | str = "cpu") -> bool:
        """Whether lossless compression is expected to shorten a transfer on this link, for a
        payload on ``device``."""
        link = self.link_gbps or DEFAULT_LINK_GBPS.get(transport_kind, 50.0)
        enc, dec = self.throughputs(device)
        return (1.0 - self.ratio()) / link > 1.0 / enc + 1.0 / dec


def choose_codec(x: object, policy: AutoCodecPolicy, transport_kind: str) -> str:
    """``"lossless"`` for bf16 payloads when ``policy`` says it pays, else ``"none"``."""
    if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16:
        return "none"
    try:
        return "lossless" if policy.pays(transport_kind, x.device) else "none"
    except RuntimeError:  # the C++ codec is not built
        return "none"
