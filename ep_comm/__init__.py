"""ep_comm: Mixture-of-Experts expert-parallel dispatch/combine with DeepEP's V1 API.

Public API (see docs/design.md): ``Buffer``, ``DispatchHandle``, ``LowLatencyHandle``, ``CommStats``,
``CommTimeoutError`` (and its ``StoreLostError``), ``BufferStateError``, ``EventOverlap``, ``Config``,
the differentiable ``dispatch`` / ``combine``, and ``build_info()``.
"""
from . import moe
from ._build import build_info
from .autograd import combine, dispatch
from .buffer import Buffer
from .config import Config
from .errors import BufferStateError, CommTimeoutError, StoreLostError
from .event import EventHandle, EventOverlap
from .handle import DispatchHandle, InternodeDispatchHandle, IntranodeDispatchHandle, LowLatencyHandle
from .placement import ExpertPlacement
from .stats import CommStats

__all__ = [
    "Buffer", "BufferStateError", "CommStats", "CommTimeoutError", "Config", "DispatchHandle", "EventHandle",
    "EventOverlap", "ExpertPlacement", "InternodeDispatchHandle", "IntranodeDispatchHandle", "LowLatencyHandle",
    "StoreLostError", "build_info", "combine", "dispatch", "moe",
]
__version__ = "0.1.0"
