"""``deep_ep.utils.envs``: see :mod:`ep_comm.integrations.deep_ep_utils.envs`."""
from ep_comm.integrations.deep_ep_utils.envs import (
    dist_print,
    get_global_seed,
    get_local_seed,
    get_logical_domain_size,
    get_physical_domain_size,
    init_dist,
    init_seed,
)

__all__ = ["dist_print", "get_global_seed", "get_local_seed", "get_logical_domain_size",
           "get_physical_domain_size", "init_dist", "init_seed"]
