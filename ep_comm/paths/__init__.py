"""Paths: the implementations of the Buffer's calls, and the one place that picks one per call.

A Buffer holds its paths in order of preference (two-hop kernels, node-aware, fused kernels,
flat) in a :class:`PathPlan`; each call goes to the first path that takes it.
"""
from .base import (
    MODES,
    CachedDispatchCall,
    CombineCall,
    DispatchCall,
    LowLatencyCombineCall,
    LowLatencyDispatchCall,
    Path,
    PathChoice,
    PathPlan,
)
from .flat import FlatPath
from .fused import FusedKernelPath
from .node_aware import NodeAwarePath
from .two_hop import TwoHopKernelPath

__all__ = [
    "MODES", "CachedDispatchCall", "CombineCall", "DispatchCall", "FlatPath", "FusedKernelPath",
    "LowLatencyCombineCall", "LowLatencyDispatchCall", "NodeAwarePath", "Path", "PathChoice", "PathPlan",
    "TwoHopKernelPath",
]
