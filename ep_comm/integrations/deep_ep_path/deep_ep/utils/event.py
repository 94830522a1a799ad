"""``deep_ep.utils.event``: see :mod:`ep_comm.integrations.deep_ep_utils.event`."""
from ep_comm.integrations.deep_ep_utils.event import EventHandle, EventOverlap

__all__ = ["EventHandle", "EventOverlap"]
