"""``deep_ep`` served by ep_comm: DeepEP's V1 ``Buffer`` API and DeepEP 2.x's top-level helpers.

This package exists only on the ``sys.path`` entry that ep_comm adds when asked (see
:mod:`ep_comm.integrations.deep_ep`); every name comes from ep_comm. ``__version__`` gives the
DeepEP API level offered and ep_comm's version.
"""
from ep_comm.integrations.deep_ep import (
    DEEP_EP_VERSION,
    TOPK_IDX_DTYPE,
    Buffer,
    Config,
    EventHandle,
    EventOverlap,
    get_logical_domain_size,
    get_physical_domain_size,
    warn_if_shadowing,
)

from . import utils

__all__ = ["Buffer", "Config", "EventHandle", "EventOverlap", "get_logical_domain_size",
           "get_physical_domain_size", "topk_idx_t", "utils"]
__version__ = DEEP_EP_VERSION
__ep_comm__ = True
topk_idx_t = TOPK_IDX_DTYPE

warn_if_shadowing()
