"""ep-bench: ep_comm's microbenchmark, its baselines, and the scale-out model.

Run ``ep-bench --help`` (or ``python -m ep_comm.bench``); ``main`` is the entry point.
"""
from .main import main

__all__ = ["main"]
