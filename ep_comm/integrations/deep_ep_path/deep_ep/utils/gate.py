"""``deep_ep.utils.gate``: see :mod:`ep_comm.integrations.deep_ep_utils.gate`."""
from ep_comm.integrations.deep_ep_utils.gate import (
    get_precise_unbalanced_scores,
    get_random_unbalanced_scores,
    get_scores_by_factor,
    get_unbalanced_scores,
    map_unbalanced_ratio_to_factor,
)

__all__ = ["get_precise_unbalanced_scores", "get_random_unbalanced_scores", "get_scores_by_factor",
           "get_unbalanced_scores", "map_unbalanced_ratio_to_factor"]
