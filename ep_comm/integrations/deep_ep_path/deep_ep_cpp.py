"""``deep_ep_cpp`` (DeepEP V1's extension module): the names client code imports from it, from ep_comm."""
from ep_comm.integrations.deep_ep import TOPK_IDX_DTYPE, Config, EventHandle

__all__ = ["Config", "EventHandle", "topk_idx_t"]
__ep_comm__ = True
topk_idx_t = TOPK_IDX_DTYPE
