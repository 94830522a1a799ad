"""``deep_ep.buffers.legacy``: DeepEP 2.x's path of the V1 ``Buffer`` (ep_comm's Buffer)."""
from ep_comm.integrations.deep_ep import Buffer

__all__ = ["Buffer"]
