"""``deep_ep.utils.event``: DeepEP's ``EventOverlap`` and ``EventHandle``, as ep_comm defines them."""
from ...event import EventHandle, EventOverlap

__all__ = ["EventHandle", "EventOverlap"]
