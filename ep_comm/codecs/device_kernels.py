"""Access to the codecs' CUDA kernels (``ep_comm._cuda``, bound in csrc/cuda_bindings/codecs.cpp):
which module holds them for a device, and the device context and stream their launches use."""
from __future__ import annotations

import torch


def codec_kernels(device: torch.device):
    """``ep_comm._cuda`` when ``device`` is a GPU that module has code for (its compute
    capability among the built ``archs``) and the module holds the codec kernels; else None (the
    codecs then run on the CPU, or as torch operations)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    from .._build import load_cuda

    try:
        _cuda = load_cuda()
    except ImportError:
        return None
    if not (hasattr(_cuda, "lossless_encode") and hasattr(_cuda, "fp8_quantize")):
        return None
    major, minor = torch.cuda.get_device_capability(device)
    built = str(getattr(_cuda, "archs", "")).split(";")
    return _cuda if f"{major}{minor}" in built else None


def launch_context(device: torch.device):
    """Context in which ``device`` is the current CUDA device (allocations and launches)."""
    return torch.cuda.device(device)


def current_stream(device: torch.device) -> int:
    """The raw handle of ``device``'s current stream, which the kernels are launched on."""
    return torch.cuda.current_stream(device).cuda_stream
