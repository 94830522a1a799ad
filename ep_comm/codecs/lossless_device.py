"""The lossless codec on the GPU: the CUDA kernels of ``csrc/cuda/lossless_kernels.cu`` (in
``ep_comm._cuda``) behind :mod:`ep_comm.codecs.lossless` for CUDA tensors, so that a payload on
the GPU is coded there and its blob stays there.

The kernels compile the same core as the host build, so a device blob is byte-identical to the
host encoder's and either side decodes the other's blobs. Each call synchronises its stream once:
an encode to learn the blob's size, a decode to read the kernels' status (a corrupted blob raises
the ``ValueError`` the host decoder raises for it). Workspaces come from torch's caching
allocator, on the current stream of the tensor's device.
"""
from __future__ import annotations

import torch

from . import device_kernels


def _host():
    from ep_comm import _host

    return _host


def available(device: torch.device) -> bool:
    """True when tensors on ``device`` are coded by the CUDA kernels (a CUDA device, and
    ``ep_comm._cuda`` built with them); otherwise :mod:`lossless` codes on the CPU."""
    return device_kernels.codec_kernels(device) is not None


def encode(x: torch.Tensor, chunk_values: int) -> torch.Tensor:
    """``x`` (bf16 CUDA tensor, any shape) -> 1-D uint8 blob on ``x``'s device.

    ``chunk_values`` is checked by the caller (a multiple of 32 in [32, 2**24])."""
    kernels = device_kernels.codec_kernels(x.device)
    values = x.detach().contiguous().view(torch.int16).reshape(-1)
    n, shape, device = values.numel(), [int(d) for d in x.shape], x.device
    with device_kernels.launch_context(device):
        workspace = torch.empty(kernels.lossless_encode_workspace_bytes(n, chunk_values), dtype=torch.uint8,
                                device=device)
        out = torch.empty(kernels.lossless_max_blob_bytes(n, len(shape), chunk_values), dtype=torch.uint8,
                          device=device)
        size = torch.zeros(1, dtype=torch.int64, device=device)
        kernels.lossless_encode(values.data_ptr(), n, shape, chunk_values, out.data_ptr(), size.data_ptr(),
                                workspace.data_ptr(), workspace.numel(), device_kernels.current_stream(device))
        blob_bytes = int(size.item())
    # an exact-size copy: the capacity-sized buffer goes back to the allocator
    return out[:blob_bytes].clone()


def header(blob: torch.Tensor) -> tuple[tuple[int, ...], int]:
    """``(shape, chunk_values)`` that a blob (1-D uint8, any device) declares, after every check
    the host decoder makes before it allocates (header, table, metadata checksum, chunk
    directory, sizes): its metadata is copied to the host (two small copies: the fixed header,
    then header, table and directory, about 16 bytes per chunk). ``ValueError`` if it is bad."""
    host = _host()
    size = blob.numel()
    prefix = blob[: min(size, host.LOSSLESS_HEADER_PREFIX_BYTES)].to("cpu").contiguous()
    metadata_bytes = host.lossless_metadata_bytes(prefix.numpy(), size)
    metadata = blob[:metadata_bytes].to("cpu").contiguous()
    shape, chunk_values = host.lossless_parse_metadata(metadata.numpy(), size)
    return tuple(shape), int(chunk_values)


def decode_into(blob: torch.Tensor, out: torch.Tensor, chunk_values: int) -> None:
    """Decodes ``blob`` (1-D uint8, on ``out``'s device) into ``out`` (contiguous bf16 CUDA
    tensor of the blob's shape, as :func:`header` read it with ``chunk_values``).

    Raises:
        ValueError: the blob is corrupted (the host decoder's message); ``out`` is then
            unspecified.
    """
    kernels = device_kernels.codec_kernels(out.device)
    device = out.device
    flat = out.view(torch.int16).reshape(-1)
    n = flat.numel()
    with device_kernels.launch_context(device):
        workspace = torch.empty(kernels.lossless_decode_workspace_bytes(n, chunk_values), dtype=torch.uint8,
                                device=device)
        status = torch.zeros(1, dtype=torch.int32, device=device)
        kernels.lossless_decode(blob.data_ptr(), blob.numel(), flat.data_ptr(), n, chunk_values, status.data_ptr(),
                                workspace.data_ptr(), workspace.numel(), device_kernels.current_stream(device))
        code = int(status.item())
    if code != 0:
        raise ValueError(f"lossless blob: {_host().lossless_error_message(code)}")
