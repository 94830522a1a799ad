"""Row work on the host side of a path: byte views, row gather-scatter, per-token sums, and the
pool of reused message bytes.

Byte views (:func:`widest_view`, :func:`wide_pair`): row gathers and scatters move whole rows, and
on the CPU they run several times faster on 8-byte elements than on 2-byte ones.

Row gather-scatter (:func:`copy_rows`), ``dst[dst_index[i]] = src[src_index[i]]`` along dim 0: for
CPU tensors whose rows are contiguous (a row's elements adjacent; rows may be strided, as the
fields of a packed message are), ``ep_comm._host.copy_rows`` copies each row once with ``memcpy``;
GPU tensors of that layout take the Triton kernel of ``ep_comm.row_kernels`` (one launch, each row
copied once); elsewhere it is ``index_copy_`` of an ``index_select``, which copies every row twice
through a temporary.

Sums: combines' reductions, the rows returned to a rank summed per source token in a fixed order,
with one result on every device. Normal mode (:func:`reduce_by_source`): token ``t``'s sum is
``((0 + r_a) + r_b) + ...`` in float32 (float64 for float64 rows) over its returned rows
``a < b < ...`` in row order (destination rank ascending), then each bias added, then cast to the
rows' dtype. Low-latency mode (:func:`weighted_sum_by_token`): the same over each token's rows in
top-k order, each row times its top-k weight first (the product rounded to float32). For bf16 /
float32 rows on the CPU ``ep_comm._host.sum_rows_by_token`` makes these float operations in this
order straight from the received buffer (no gathered or float32 copies of the rows); for bf16 /
float16 / float32 rows on a GPU the Triton kernels of ``ep_comm.row_kernels`` do; both give the
torch path's bits, but for NaNs: where a NaN is added to a NaN, which one's sign and payload
survive depends on the order of the add's operands, which neither torch nor the compiler fixes.
Elsewhere the sums are ``index_add_`` calls: the reference on the CPU, but on a GPU (Triton absent,
``EP_COMM_TRITON=0``, float64 rows) they add with atomics in no fixed order.

Scratch (:class:`ScratchPool`): reusable byte buffers for messages that never leave the library.
Low-latency calls move the same large messages on every call (a rank's send and receive bytes:
about 7 MB each for dispatch and 15 MB each for combine at 128 tokens x 7168 on 4 ranks). Fresh
tensors for them are faulted in page by page on every call on the CPU; a Buffer's pool hands the
same memory back instead. A buffer is taken for one message and given back only once the message
is consumed (its exchange finished and its bytes read), so two calls in flight (a receive hook not
called yet) never share one: a take finding no free buffer of the role allocates a new one.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from . import row_kernels
from .plan import SendPlan

try:  # the C++ host module; without it the torch forms do the same copies and sums
    from ep_comm import _host
except ImportError:  # pragma: no cover - only an unbuilt checkout
    _host = None

_WIDE_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8)


def widest_view(t: torch.Tensor) -> torch.Tensor:
    """The same bytes viewed with the widest integer element the last dimension allows.

    Row gathers and scatters (``index_select``, ``index_copy_``) move whole rows; on the CPU they
    run several times faster on 8-byte elements than on 2-byte ones, and the bytes are identical.
    """
    if t.dim() == 0 or t.shape[-1] == 0:
        return t
    for dtype in _WIDE_DTYPES:
        if dtype.itemsize < t.element_size():
            break
        try:
            return t.view(dtype)
        except RuntimeError:
            continue
    return t


def wide_pair(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`widest_view` of two tensors with rows of equal bytes, in a dtype both allow."""
    wa, wb = widest_view(a), widest_view(b)
    if wa.dtype == wb.dtype:
        return wa, wb
    narrow = wa.dtype if wa.element_size() < wb.element_size() else wb.dtype
    return a.view(narrow), b.view(narrow)


# ---- row gather-scatter ----------------------------------------------------------------------

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
    if row_kernels.usable(dst, src, dst_index, src_index) and row_kernels.copy_rows(dst, dst_index, src, src_index):
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


# ---- per-token sums --------------------------------------------------------------------------

_HOST_DTYPE_CODES = {torch.bfloat16: 0, torch.float32: 1}


def reduce_by_source(rows: torch.Tensor | Sequence[torch.Tensor], plan: SendPlan, num_tokens: int,
                     bias: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Sums returned rows per source token (deterministic: see the module docstring).

    Args:
        rows: ``[S, W]`` returned rows in ``plan.token_index`` order, or consecutive blocks of
            them (``[s_i, W]`` each, e.g. one per source rank as received; concatenated they are
            the ``[S, W]`` rows; at least one block, possibly ``[0, W]``), all of one dtype and
            device.
        plan: the send plan whose ``token_index [S]`` int64 names each row's token.
        num_tokens: ``N``, rows of the result.
        bias: up to two ``[N, W]`` tensors added to the sums.
    Returns:
        ``[N, W]`` in the rows' dtype, accumulated in float32 (float64 for float64 rows).
    """
    blocks = [rows] if isinstance(rows, torch.Tensor) else list(rows)
    if not blocks:
        raise ValueError("rows must be a tensor or a non-empty list of row blocks")
    dtype, device, width = blocks[0].dtype, blocks[0].device, blocks[0].shape[1]
    acc_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    if row_kernels.usable(*blocks, plan.token_index, *bias):
        summed = row_kernels.reduce_by_source(blocks, plan.token_index, num_tokens, bias)
        if summed is not None:
            return summed
    if _host_can_sum(blocks, plan):
        acc = torch.empty(num_tokens, width, dtype=torch.float32)
        index = plan.token_index
        _host.sum_rows_by_token(acc.data_ptr(), num_tokens, width, [b.data_ptr() for b in blocks],
                                [b.shape[0] for b in blocks], index.data_ptr(), index.numel(),
                                _HOST_DTYPE_CODES[dtype], max(1, torch.get_num_threads()))
    else:
        flat = blocks[0] if len(blocks) == 1 else torch.cat(blocks)
        acc = torch.zeros(num_tokens, width, dtype=acc_dtype, device=device)
        start = 0
        for count in plan.splits():
            segment = slice(start, start + count)
            acc.index_add_(0, plan.token_index[segment], flat[segment].to(acc_dtype))
            start += count
    for b in bias:
        acc += b.to(acc_dtype)
    return acc.to(dtype)


def _host_can_sum(blocks: list[torch.Tensor], plan: SendPlan) -> bool:
    """Whether the C++ host sum takes these blocks: CPU, bf16 or float32, 2-D, contiguous and
    aligned, one dtype and width, with a CPU int64 contiguous token index of their rows."""
    if _host is None or not hasattr(_host, "sum_rows_by_token"):
        return False
    first = blocks[0]
    if first.dtype not in _HOST_DTYPE_CODES:
        return False
    index = plan.token_index
    if not (index.is_cpu and index.dtype == torch.int64 and index.is_contiguous()):
        return False
    if index.numel() != sum(b.shape[0] for b in blocks):
        return False
    return all(b.is_cpu and b.dim() == 2 and b.dtype == first.dtype and b.shape[1] == first.shape[1]
               and b.is_contiguous() and b.data_ptr() % b.element_size() == 0 and not b.is_neg()
               and not b.is_conj() for b in blocks)


def weighted_sum_by_token(rows: torch.Tensor, order: torch.Tensor, tokens: torch.Tensor,
                          weights: torch.Tensor, num_tokens: int, block_rows: int) -> torch.Tensor:
    """Low-latency combine's sum: ``acc[tokens[i]] += rows[order[i]].float() * weights[i]`` for
    ``i`` ascending, into float32 zeros.

    Args:
        rows: ``[P, H]`` bf16 returned rows, as received.
        order: ``[P]`` int64, the rows in summation order (each token's rows in top-k order).
        tokens: ``[P]`` int64, the token of each row of ``order``; weights: ``[P]`` float32, its
            top-k weight.
        block_rows: rows gathered and converted at a time on the torch path (bounds its float32
            temporaries).
    Returns:
        ``[num_tokens, H]`` float32.
    """
    hidden = rows.shape[1]
    if (_host is not None and hasattr(_host, "sum_rows_by_token") and rows.dtype in _HOST_DTYPE_CODES
            and rows.is_cpu and rows.is_contiguous() and not rows.is_neg()
            and rows.data_ptr() % rows.element_size() == 0):
        acc = torch.empty(num_tokens, hidden, dtype=torch.float32)
        order = order.to(torch.int64).contiguous()
        tokens = tokens.to(torch.int64).contiguous()
        weights = weights.to(torch.float32).contiguous()
        _host.sum_rows_by_token(acc.data_ptr(), num_tokens, hidden, [rows.data_ptr()], [rows.shape[0]],
                                tokens.data_ptr(), tokens.numel(), _HOST_DTYPE_CODES[rows.dtype],
                                max(1, torch.get_num_threads()), order.data_ptr(), weights.data_ptr())
        return acc
    if row_kernels.usable(rows, order, tokens, weights):
        acc = row_kernels.weighted_sum_by_token(rows, order, tokens, weights, num_tokens)
        if acc is not None:
            return acc
    acc = torch.zeros(num_tokens, hidden, dtype=torch.float32, device=rows.device)
    wide_rows = widest_view(rows)
    column = weights.to(torch.float32).unsqueeze(1)
    # consecutive blocks keep each token's order and keep the float32 temporaries small enough to
    # be reused instead of faulted in
    for start in range(0, order.numel(), block_rows):
        block = slice(start, start + block_rows)
        scaled = wide_rows.index_select(0, order[block]).view(rows.dtype).float().mul_(column[block])
        acc.index_add_(0, tokens[block], scaled)
    return acc


# ---- reused message bytes --------------------------------------------------------------------

class ScratchPool:
    """Free uint8 buffers per (role, device), at most ``keep`` each (the largest kept).

    Not thread-safe: one Buffer's calls are made from one thread, as DeepEP's are.
    """

    def __init__(self, keep: int = 2) -> None:
        self.keep = keep
        self._free: dict[tuple[str, torch.device], list[torch.Tensor]] = {}

    def take(self, role: str, nbytes: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(buffer, bytes)``: a buffer of at least ``nbytes`` (give it back with :meth:`give`
        once its message is consumed) and its first ``nbytes`` as a 1-D uint8 view (contents
        undefined)."""
        free = self._free.get((role, torch.device(device)), [])
        fits = [i for i, buffer in enumerate(free) if buffer.numel() >= nbytes]
        if fits:  # the smallest that fits, so that a larger message later finds the larger one
            buffer = free.pop(min(fits, key=lambda i: free[i].numel()))
            return buffer, buffer[:nbytes]
        # room to grow: a message whose size varies with the routing (combine) reuses the buffer
        # when it is up to an eighth larger next time
        buffer = torch.empty(nbytes + nbytes // 8, dtype=torch.uint8, device=device)
        return buffer, buffer[:nbytes]

    def give(self, role: str, buffer: torch.Tensor) -> None:
        """Returns a buffer from :meth:`take` whose message is consumed."""
        free = self._free.setdefault((role, buffer.device), [])
        free.append(buffer)
        free.sort(key=lambda t: t.numel(), reverse=True)
        del free[self.keep:]

    def clear(self) -> None:
        self._free.clear()

    def held_bytes(self) -> int:
        return sum(t.numel() for free in self._free.values() for t in free)
