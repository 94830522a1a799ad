"""``deep_ep.utils.refs``: see :mod:`ep_comm.integrations.deep_ep_utils.refs`."""
from ep_comm.integrations.deep_ep_utils.refs import combine, dispatch, generate_pre_combine_data, ordered_accumulate

__all__ = ["combine", "dispatch", "generate_pre_combine_data", "ordered_accumulate"]
