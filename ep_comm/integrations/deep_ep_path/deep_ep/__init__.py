"""``deep_ep`` served by ep_comm: DeepEP 2.x's top-level names (V1's ``Buffer``, ``ElasticBuffer``, ...).

This package exists only on the ``sys.path`` entry that ep_comm adds when asked (see
:mod:`ep_comm.integrations.deep_ep`); every name comes from ep_comm. ``__version__`` gives the
DeepEP API level offered and ep_comm's version.
"""
from ep_comm.integrations.deep_ep import (
    DEEP_EP_VERSION,
    TOPK_IDX_DTYPE,
    Buffer,
    Config,
    ElasticBuffer,
    EPHandle,
    EventHandle,
    EventOverlap,
    get_logical_domain_size,
    get_physical_domain_size,
    warn_if_shadowing,
)

from . import buffers, utils

__all__ = ["Buffer", "Config", "EPHandle", "ElasticBuffer", "EventHandle", "EventOverlap", "buffers",
           "get_logical_domain_size", "get_physical_domain_size", "topk_idx_t", "utils"]
__version__ = DEEP_EP_VERSION
__ep_comm__ = True
topk_idx_t = TOPK_IDX_DTYPE

warn_if_shadowing()
