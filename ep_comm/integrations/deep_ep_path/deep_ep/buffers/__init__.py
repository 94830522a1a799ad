"""``deep_ep.buffers``: DeepEP 2.x's module paths, served by ep_comm."""
from . import elastic, legacy

__all__ = ["elastic", "legacy"]
