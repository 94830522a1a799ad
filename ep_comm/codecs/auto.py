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

:func:`compression_pays` is the rule itself and :func:`break_even_gbps` its threshold; the Buffer
(through :class:`AutoCodecPolicy`) and ``ep-bench --simulate`` both decide with them.
"""
from __future__ import annotations

import math
import numbers
import time
from dataclasses import dataclass, field

import torch

DEFAULT_LINK_GBPS = {"gloo": 2.0, "nccl": 50.0, "rccl": 50.0, "nvshmem": 50.0}
"""Per-transport default link bandwidth in GB/s: TCP on one host; 400 Gb/s RDMA between nodes."""


def compression_pays(link_gbps: float, ratio: float, encode_gbps: float, decode_gbps: float) -> bool:
    """The rule in this module's docstring: ``(1 - ratio) / link > 1 / encode + 1 / decode``.

    Args:
        link_gbps: link bandwidth ``L`` (GB/s).
        ratio: ``rho`` = compressed bytes / raw bytes.
        encode_gbps / decode_gbps: codec throughputs on raw bytes (GB/s); ``math.inf`` = free.
    """
    for name, value in (("link_gbps", link_gbps), ("encode_gbps", encode_gbps), ("decode_gbps", decode_gbps)):
        _check_speed(name, value)
    return (1.0 - ratio) / link_gbps > 1.0 / encode_gbps + 1.0 / decode_gbps


def _check_speed(name: str, value: object) -> float:
    """``value`` as a float, or ValueError naming ``name`` unless it is a positive number (GB/s;
    ``math.inf`` allowed)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or math.isnan(value) or value <= 0:
        raise ValueError(f"{name} must be a positive number of GB/s, got {value!r}")
    return float(value)


def break_even_gbps(link_gbps: float, ratio: float) -> float:
    """The codec throughput (encode and decode alike, GB/s) above which :func:`compression_pays`
    says yes: ``2 L / (1 - rho)``; ``math.inf`` when ``rho >= 1`` (nothing saved, never pays).

    With unequal speeds the rule asks ``1 / enc + 1 / dec < (1 - rho) / L``, i.e. their harmonic
    mean above this figure."""
    saved = 1.0 - ratio
    return 2.0 * link_gbps / saved if saved > 0 else math.inf


def measure_codec_gbps(sample: torch.Tensor, threads: int | None = None, repeats: int = 1) -> tuple[float, float]:
    """``(encode, decode)`` GB/s of raw bytes for the lossless codec on bf16 ``sample``, coded
    where the sample lies (the CUDA kernels for a CUDA tensor when built, else the CPU) as the
    transport codes a message there: its chunk size, and ``threads`` CPU threads (None = the
    transport's :func:`~ep_comm.codecs.lossless.message_threads`). One untimed warm-up, then the
    fastest of ``repeats`` timed runs (each call returns synchronised)."""
    from . import lossless

    if not isinstance(sample, torch.Tensor) or sample.dtype != torch.bfloat16 or sample.numel() == 0:
        raise ValueError("sample must be a non-empty bf16 tensor")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    chunk_values = lossless.message_chunk_values(sample.device)
    threads = lossless.message_threads() if threads is None else threads
    lossless.decode(lossless.encode(sample, chunk_values=chunk_values, threads=threads), threads=threads)
    enc = dec = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        blob = lossless.encode(sample, chunk_values=chunk_values, threads=threads)
        middle = time.perf_counter()
        lossless.decode(blob, threads=threads)
        end = time.perf_counter()
        enc, dec = min(enc, middle - start), min(dec, end - middle)
    nbytes = sample.numel() * sample.element_size()
    return nbytes / max(enc, 1e-9) / 1e9, nbytes / max(dec, 1e-9) / 1e9


def codec_place(device: torch.device | str) -> torch.device:
    """Where the lossless codec runs for a payload on ``device``: that device when the CUDA codec
    kernels are built for it, else the CPU."""
    from . import lossless_device

    try:
        device = torch.device(device)
    except (TypeError, RuntimeError) as error:
        raise ValueError(f"device must be a torch.device or a device string, got {device!r}") from error
    return device if lossless_device.available(device) else torch.device("cpu")


@dataclass
class AutoCodecPolicy:
    """Inputs of the rule in this module's docstring.

    Attributes:
        link_gbps: link bandwidth ``L`` (GB/s); None = the transport's default.
        encode_gbps / decode_gbps: codec throughputs (GB/s); None = measure once.
        Speeds must be positive (``math.inf`` = free) and ratios finite and >= 0: a bad value
        raises ValueError naming the field where it is set.
        expected_ratio: ``rho`` until a lossless message has been sent.
        observed_ratio: updated from every lossless message (an exponential average).
    """

    link_gbps: float | None = None
    encode_gbps: float | None = None
    decode_gbps: float | None = None
    expected_ratio: float = 0.7
    observed_ratio: float | None = None
    _measured: dict[str, dict[str, float]] = field(default_factory=dict, repr=False)

    def __setattr__(self, name: str, value: object) -> None:
        """Each input checked as it is set (a bad one would fail inside a call, on one rank)."""
        if name in ("link_gbps", "encode_gbps", "decode_gbps") and value is not None:
            value = _check_speed(name, value)
        elif name in ("expected_ratio", "observed_ratio") and not (value is None and name == "observed_ratio"):
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 <= value < math.inf:
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
            value = float(value)
        object.__setattr__(self, name, value)

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
        where = codec_place(device)
        key = str(where)
        if key not in self._measured:
            sample = (torch.randn(512, 1024) * 0.05).to(torch.bfloat16).to(where)
            enc, dec = measure_codec_gbps(sample)
            self._measured[key] = {"encode": enc, "decode": dec}
        measured = self._measured[key]
        return (self.encode_gbps if self.encode_gbps is not None else measured["encode"],
                self.decode_gbps if self.decode_gbps is not None else measured["decode"])

    def pays(self, transport_kind: str, device: torch.device | str = "cpu") -> bool:
        """Whether lossless compression is expected to shorten a transfer on this link, for a
        payload on ``device``."""
        link = self.link_gbps if self.link_gbps is not None else DEFAULT_LINK_GBPS.get(transport_kind, 50.0)
        enc, dec = self.throughputs(device)
        return compression_pays(link, self.ratio(), enc, dec)


def choose_codec(x: object, policy: AutoCodecPolicy, transport_kind: str) -> str:
    """``"lossless"`` for bf16 payloads when ``policy`` says it pays, else ``"none"``."""
    if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16:
        return "none"
    try:
        return "lossless" if policy.pays(transport_kind, x.device) else "none"
    except RuntimeError:  # the C++ codec is not built
        return "none"


def agree_on_codec(x: object, policy: AutoCodecPolicy, transport: object,
                   masked: frozenset[int] = frozenset()) -> str:
    """``codec="auto"`` for one call, the same on every rank: each rank applies
    :func:`choose_codec` to its own data and speeds, and the call compresses only if every live
    rank votes for it (one count exchange over ``transport``), so all ranks use one wire format."""
    kind = "nvshmem" if transport.name == "nvshmem" else getattr(transport, "backend_name", transport.name)
    mine = choose_codec(x, policy, kind)
    vote = torch.full((transport.num_ranks, 1), int(mine == "lossless"), dtype=torch.int64)
    votes = transport.exchange_counts(vote, "auto_codec/vote")
    live = [r for r in range(transport.num_ranks) if r not in masked]
    return "lossless" if bool((votes[live] == 1).all()) else "none"


def check_codec_input(codec: str, x: object, hidden: int) -> str:
    """``codec`` after checking that it can code ``x`` (a tensor or an FP8 tuple); ValueError
    naming the codec otherwise."""
    if codec in ("fp8", "lossless") and isinstance(x, tuple):
        raise ValueError(f"codec={codec!r} cannot apply to an FP8 tuple input (already encoded)")
    if codec == "fp8" and hidden % 128 != 0:
        raise ValueError(f"codec='fp8' needs a hidden size divisible by 128, got {hidden}")
    if codec == "lossless" and x.dtype != torch.bfloat16:  # type: ignore[union-attr]
        raise ValueError(f"codec='lossless' codes bf16 payloads, x is {x.dtype}")  # type: ignore[union-attr]
    return codec
