"""``deep_ep.utils.math``: see :mod:`ep_comm.integrations.deep_ep_utils.math`."""
from ep_comm.integrations.deep_ep_utils.math import (
    align,
    calc_diff,
    ceil_div,
    count_bytes,
    create_grouped_scores,
    hash_tensor,
    hash_tensors,
    inplace_unique,
    per_token_cast_back,
    per_token_cast_to_fp8,
    safe_div,
)

__all__ = ["align", "calc_diff", "ceil_div", "count_bytes", "create_grouped_scores", "hash_tensor",
           "hash_tensors", "inplace_unique", "per_token_cast_back", "per_token_cast_to_fp8", "safe_div"]
