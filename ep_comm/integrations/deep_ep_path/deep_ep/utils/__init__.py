"""``deep_ep.utils``: DeepEP's helper modules, implemented in :mod:`ep_comm.integrations.deep_ep_utils`."""
from ep_comm.integrations.deep_ep_utils.event import EventHandle, EventOverlap

from . import envs, event, gate, math, refs, testing

__all__ = ["EventHandle", "EventOverlap", "envs", "event", "gate", "math", "refs", "testing"]
