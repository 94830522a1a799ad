"""Row gather-scatter (ep_comm/row_copy.py): the C++ host copy against index_copy_ of an
index_select, on contiguous and strided rows of several dtypes, and its index checks."""
from __future__ import annotations

import pytest
import torch

from ep_comm import _host
from ep_comm.rows import _host_can_copy, copy_rows


def _reference(dst, dst_index, src, src_index):
    out = dst.clone()
    out.view(torch.uint8).view(dst.shape[0], -1).index_copy_(
        0, dst_index, src.contiguous().view(torch.uint8).view(src.shape[0], -1).index_select(0, src_index))
    return out


@pytest.mark.parametrize("threads", [1, 3])
def test_host_copy_equals_index_copy(threads, monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    g = torch.Generator().manual_seed(threads)
    # strided rows: a field of a packed byte matrix (rows of 40 bytes, the field at bytes 8..24)
    packed = torch.randint(0, 255, (50, 40), dtype=torch.uint8, generator=g)
    dst = packed[:, 8:24].view(torch.bfloat16)  # [50, 8] bf16, row stride 40 bytes
    src = torch.randn(30, 4, generator=g)  # [30, 4] float32: 16 bytes per row too
    dst_index = torch.randperm(50, generator=g)[:20]
    src_index = torch.randint(0, 30, (20,), generator=g)
    assert _host_can_copy(dst, src, dst_index, src_index)
    want = _reference(dst, dst_index, src, src_index)
    before = packed.clone()
    copy_rows(dst, dst_index, src, src_index)
    assert torch.equal(dst.view(torch.uint8), want.view(torch.uint8))
    untouched = torch.ones(40, dtype=torch.bool)
    untouched[8:24] = False
    assert torch.equal(packed[:, untouched], before[:, untouched])  # bytes outside the field


def test_empty_and_torch_fallback():
    dst = torch.zeros(4, 3, dtype=torch.int32)
    copy_rows(dst, torch.empty(0, dtype=torch.int64), torch.ones(2, 3, dtype=torch.int32),
              torch.empty(0, dtype=torch.int64))
    assert not bool(dst.any())
    dst_t = torch.zeros(3, 4, dtype=torch.int32).t()  # elements of a row not adjacent: torch path
    assert not _host_can_copy(dst_t, torch.ones(2, 3, dtype=torch.int32), torch.tensor([1]), torch.tensor([0]))
    copy_rows(dst_t, torch.tensor([1, 3]), torch.arange(6, dtype=torch.int32).view(2, 3), torch.tensor([1, 0]))
    assert dst_t[1].tolist() == [3, 4, 5] and dst_t[3].tolist() == [0, 1, 2] and int(dst_t[0].sum()) == 0


def test_bad_indices_and_sizes_raise():
    dst = torch.zeros(4, 2)
    src = torch.ones(3, 2)
    with pytest.raises(ValueError, match="dst_index holds 4"):
        copy_rows(dst, torch.tensor([4]), src, torch.tensor([0]))
    with pytest.raises(ValueError, match="src_index holds -1"):
        copy_rows(dst, torch.tensor([0]), src, torch.tensor([-1]))
    with pytest.raises(ValueError, match="rows of 8 bytes"):
        copy_rows(dst, torch.tensor([0]), torch.ones(3, 3), torch.tensor([0]))
    with pytest.raises(ValueError, match="row_bytes exceeds"):
        _host.copy_rows(dst.data_ptr(), 4, 4, torch.tensor([0]).data_ptr(), src.data_ptr(), 3, 8,
                        torch.tensor([0]).data_ptr(), 1, 8, 1)


def test_broadcast_source_takes_the_torch_path():
    """An expand-ed source (row stride 0, as a broadcast x) is copied correctly, not rejected."""
    src = torch.arange(4, dtype=torch.float32).unsqueeze(0).expand(5, 4)
    dst = torch.zeros(3, 4)
    assert not _host_can_copy(dst, src, torch.tensor([0]), torch.tensor([0]))
    copy_rows(dst, torch.tensor([2, 0]), src, torch.tensor([4, 1]))
    assert dst[0].tolist() == [0, 1, 2, 3] and dst[2].tolist() == [0, 1, 2, 3] and int(dst[1].sum()) == 0
