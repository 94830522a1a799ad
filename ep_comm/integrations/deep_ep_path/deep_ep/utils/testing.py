"""``deep_ep.utils.testing``: see :mod:`ep_comm.integrations.deep_ep_utils.testing`."""
from ep_comm.integrations.deep_ep_utils.testing import (
    KernelTimingUnavailableWarning,
    bench,
    bench_kineto,
    flush_l2_cache,
    suppress_stdout_stderr,
)

__all__ = ["KernelTimingUnavailableWarning", "bench", "bench_kineto", "flush_l2_cache", "suppress_stdout_stderr"]
