"""Access to the codecs' CUDA kernels (``ep_comm._cuda``, bound in csrc/cuda_bindings/codecs.cpp)."""
from __future__ import annotations

import torch


def codec_kernels(device: torch.device):
    """``ep_comm._cuda`` when ``device`` is a GPU and that module is built with the codec kernels;
    else None (the codecs then run on the CPU, or as torch operations)."""
    if device.type != "cuda":
        return None
    try:
        from ep_comm import _cuda
    except ImportError:
        return None
    return _cuda if hasattr(_cuda, "lossless_encode") and hasattr(_cuda, "fp8_quantize") else None
