"""Row gather-scatter: ``dst[dst_index[i]] = src[src_index[i]]`` along dim 0.

For CPU tensors whose rows are contiguous (a row's elements adjacent; rows may be strided, as the
fields of a packed message are), ``ep_comm._host.copy_rows`` copies each row once with ``memcpy``;
elsewhere (GPU tensors, other layouts) it is ``index_copy_`` of an ``index_select``, which copies
every row twice through a temporary.
"""
from __future__ import annotations

import torch

from .wire import wide_pair

try:  # the C++ host module; without it the torch form does the same copies
    from ep_comm import _host
except ImportError:  # pragma: no cover - only an unbuilt checkout
    _host = None


def copy_rows(dst: torch.Tensor, dst_index: torch.Tensor, src: torch.Tensor, src_index: torch.Tensor) -> None:
    """Copies rows of ``src`` into rows of ``dst``.

    Args:
        dst: ``[D, W]`` tensor written in place; src: ``[S, W']`` tensor whose rows hold the same
            number of bytes (any dtypes: the bytes are copied).
        dst_index / src_index: ``[n]`` int64 row indices; ``dst_index`` must not repeat.
    """
    if dst_index.numel() != src_index.numel():
        raise ValueError(f"dst_index has {dst_index.numel()} rows, src_index {src_index.numel()}")
    row_bytes = dst.shape[1] * dst.element_size()
    if src.shape[1] * src.element_size() != row_bytes:
        raise ValueError(f"rows of {row_bytes} bytes (dst) and {src.shape[1] * src.element_size()} bytes (src)")
    if _host_can_copy(dst, src, dst_index, src_index):
        dst_index = dst_index.to(torch.int64).contiguous()
        src_index = src_index.to(torch.int64).contiguous()
        _host.copy_rows(dst.data_ptr(), dst.shape[0], dst.stride(0) * dst.element_size(), dst_index.data_ptr(),
                        src.data_ptr(), src.shape[0], src.stride(0) * src.element_size(), src_index.data_ptr(),
                        dst_index.numel(), row_bytes, max(1, torch.get_num_threads()))
        return
    target, source = wide_pair(dst, src)
    target.index_copy_(0, dst_index, source.index_select(0, src_index))


def _host_can_copy(dst: torch.Tensor, src: torch.Tensor, dst_index: torch.Tensor, src_index: torch.Tensor) -> bool:
    """CPU rows whose elements are adjacent and which do not overlap one another (a row stride of
    at least a row; a broadcast ``expand``-ed source, stride 0, takes the torch form)."""
    if _host is None or not hasattr(_host, "copy_rows"):
        return False
    tensors_ok = all(t.is_cpu and t.dim() == 2 and (t.shape[1] <= 1 or t.stride(1) == 1)
                     and (t.shape[0] <= 1 or t.stride(0) >= t.shape[1])
                     and not t.is_neg() and not t.is_conj() for t in (dst, src))
    return tensors_ok and dst_index.is_cpu and src_index.is_cpu
