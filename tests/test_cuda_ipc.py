"""CUDA IPC peer buffers (ep_comm/backends/cuda_ipc.py) without a GPU: cuda-python error
checking, validation of the all-gathered records, and the exchange itself over a gloo group with
an in-memory stand-in for the CUDA calls (handles encode the exporting process and address; an
import maps them to a distinct address, as cudaIpcOpenMemHandle does)."""
from __future__ import annotations

import os
import struct

import pytest
import torch

from ep_comm.engines.cuda_ipc import (
    IPC_HANDLE_BYTES,
    IpcPeerBuffers,
    IpcRecord,
    IpcTensorExchange,
    check_cuda,
    validate_records,
)


def _record(rank: int, **over) -> IpcRecord:
    fields = dict(rank=rank, hostname="node0", pid=1000 + rank, device_uuid=f"gpu{rank}", nbytes=4096,
                  handle=bytes([rank]) * IPC_HANDLE_BYTES)
    fields.update(over)
    return IpcRecord(**fields)


# -- cuda-python return codes ---------------------------------------------------------------------
def test_check_cuda_returns_value_and_names_failed_call() -> None:
    runtime = pytest.importorskip("cuda.bindings.runtime")
    ok = runtime.cudaError_t.cudaSuccess
    assert check_cuda((ok, 1234), "cudaMalloc") == 1234
    assert check_cuda((ok,), "cudaFree") is None
    bad = runtime.cudaError_t.cudaErrorInvalidValue
    with pytest.raises(RuntimeError, match=r"cudaIpcOpenMemHandle failed: cudaErrorInvalidValue \(1\)"):
        check_cuda((bad, None), "cudaIpcOpenMemHandle")
    with pytest.raises(RuntimeError, match="cudaIpcCloseMemHandle failed"):
        check_cuda(bad, "cudaIpcCloseMemHandle")


# -- record validation ----------------------------------------------------------------------------
def test_validate_records_accepts_a_consistent_group() -> None:
    recs = [_record(r) for r in range(4)]
    assert validate_records(recs, 4, 4096) == recs


@pytest.mark.parametrize("bad,match", [
    (lambda rs: rs[:1], "expected 2 IPC records"),
    (lambda rs: [rs[0], _record(1, handle=b"short")], "rank 1 must be 64 bytes"),
    (lambda rs: [rs[0], _record(1, nbytes=8192)], "rank 1 allocated 8192 bytes"),
    (lambda rs: [rs[0], _record(1, hostname="node1")], "one host"),
    (lambda rs: [rs[0], _record(1, pid=1000)], "one process"),
    (lambda rs: [rs[1], rs[0]], "position 0 claims rank 1"),
    (lambda rs: [rs[0], "not a record"], "rank 1 is a str"),
])
def test_validate_records_rejects(bad, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        validate_records(bad([_record(0), _record(1)]), 2, 4096)


# -- the exchange over gloo with stand-in CUDA calls --------------------------------------------
class _FakeIpc:
    """Memory 'allocations' are addresses; a handle is (pid, address) padded to 64 bytes; opening
    it yields a per-(pid, address) mapped address, as a real import gives a new address."""

    def __init__(self, fail_open: bool = False, fail_export: bool = False) -> None:
        self.fail_open, self.fail_export = fail_open, fail_export
        self.allocated: set[int] = set()
        self.opened: dict[int, tuple[int, int]] = {}
        self.next = 0x10000

    @staticmethod
    def mapped(pid: int, address: int) -> int:
        return 0x7F0000000000 + (pid % 4096) * 0x100000000 + address

    def malloc_zeroed(self, nbytes: int) -> int:
        self.next += 0x1000000
        self.allocated.add(self.next)
        return self.next

    def free(self, ptr: int) -> None:
        if ptr not in self.allocated:
            raise RuntimeError(f"cudaFree failed: not allocated {ptr:#x}")
        self.allocated.remove(ptr)

    def get_handle(self, ptr: int) -> bytes:
        return struct.pack("<qq", os.getpid(), ptr).ljust(IPC_HANDLE_BYTES, b"\0")

    def open_handle(self, handle: bytes) -> int:
        if self.fail_open:
            raise RuntimeError("cudaIpcOpenMemHandle failed: cudaErrorMapBufferObjectFailed (205)")
        pid, address = struct.unpack("<qq", handle[:16])
        if pid == os.getpid():
            raise RuntimeError("cudaIpcOpenMemHandle failed: handle of this process")
        ptr = self.mapped(pid, address)
        self.opened[ptr] = (pid, address)
        return ptr

    def close_handle(self, ptr: int) -> None:
        if ptr not in self.opened:
            raise RuntimeError(f"cudaIpcCloseMemHandle failed: not open {ptr:#x}")
        del self.opened[ptr]

    def device_uuid(self) -> str:
        return "fake-gpu"

    def export(self, ptr: int) -> tuple[bytes, int]:
        """Allocations of 64 KiB: the handle of the one holding ``ptr`` and the offset in it."""
        if self.fail_export:
            raise RuntimeError("cudaIpcGetMemHandle failed: cudaErrorInvalidValue (1)")
        return self.get_handle(ptr & ~0xFFFF), ptr & 0xFFFF


def _exchange(rank, world, group):
    api = _FakeIpc()
    bufs = IpcPeerBuffers(1 << 20, group, torch.device("cpu"), api=api)
    table = list(bufs.peers)
    own = bufs.own
    mine = (os.getpid(), own)
    opened_before = len(api.opened)
    bufs.close()
    return dict(table=table, own=own, me=mine, opened=opened_before, left_open=len(api.opened),
                left_allocated=len(api.allocated), peers_after=bufs.peers)


def test_exchange_builds_the_peer_table_and_close_releases_all(ranks) -> None:
    results = ranks(2, _exchange)
    for rank, res in enumerate(results):
        assert res["table"][rank] == res["own"]  # own buffer: no import
        for peer in range(2):
            if peer != rank:
                pid, address = results[peer]["me"]
                assert res["table"][peer] == _FakeIpc.mapped(pid, address)
        assert res["opened"] == 1
        assert res["left_open"] == 0 and res["left_allocated"] == 0 and res["peers_after"] == []


def _one_rank_cannot_open(rank, world, group):
    api = _FakeIpc(fail_open=(rank == 1))
    try:
        IpcPeerBuffers(4096, group, torch.device("cpu"), api=api)
    except RuntimeError as error:
        return dict(error=str(error), open=len(api.opened), allocated=len(api.allocated))
    return dict(error="", open=len(api.opened), allocated=len(api.allocated))


def test_a_failed_open_raises_on_every_rank_and_releases(ranks) -> None:
    for res in ranks(2, _one_rank_cannot_open):
        assert "rank 1: cudaIpcOpenMemHandle failed" in res["error"]
        assert res["open"] == 0 and res["allocated"] == 0


def _wrong_size(rank, world, group):
    api = _FakeIpc()
    try:
        IpcPeerBuffers(4096 * (rank + 1), group, torch.device("cpu"), api=api)
    except RuntimeError as error:
        return str(error), len(api.allocated)
    return "", len(api.allocated)


def test_mismatched_sizes_are_refused_everywhere(ranks) -> None:
    for message, allocated in ranks(2, _wrong_size):
        assert "must size its buffer the same" in message and allocated == 0


def test_bad_nbytes_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="nbytes"):
        IpcPeerBuffers(0, None, torch.device("cpu"), api=_FakeIpc())  # type: ignore[arg-type]


def test_handle_bytes_round_trip_through_cuda_python_struct() -> None:
    pytest.importorskip("cuda.bindings.runtime")
    from ep_comm.engines.cuda_ipc import CudaRuntimeIpc

    api = CudaRuntimeIpc(0)
    raw = bytes(range(IPC_HANDLE_BYTES))
    handle, _keep = api.handle_from_bytes(raw)
    assert api.handle_to_bytes(handle) == raw
    with pytest.raises(ValueError, match="64 bytes"):
        api.handle_from_bytes(raw[:10])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error path without a GPU")
def test_runtime_errors_name_the_call_without_a_gpu() -> None:
    pytest.importorskip("cuda.bindings.runtime")
    from ep_comm.engines.cuda_ipc import CudaRuntimeIpc

    with pytest.raises(RuntimeError, match=r"^cudaSetDevice failed: cudaError"):
        CudaRuntimeIpc(0).malloc_zeroed(1024)


# -- the per-call exchange of tensors (IpcTensorExchange) over gloo --------------------------------
def _tensor_exchange(rank, world, group, kinds, fail_export_rank):
    api = _FakeIpc(fail_export=(rank == fail_export_rank))
    exchange = IpcTensorExchange(group, api, torch.device("cpu"))
    tensors = [torch.zeros(40000, dtype=torch.uint8), None, torch.zeros(0)]
    mine = [(os.getpid(), int(tensors[0].data_ptr()))]
    try:
        table = exchange.exchange(kinds[rank], tensors)
    except ValueError as error:
        return {"error": str(error)}
    exchange.close()
    return {"table": table, "me": mine, "left_open": len(api.opened), "opens": exchange.imports.opens,
            "refusal": exchange.last_refusal}


def test_tensor_exchange_maps_every_peer_tensor(ranks) -> None:
    results = ranks(2, _tensor_exchange, (1, 1), -1)
    for rank, res in enumerate(results):
        table = res["table"]
        assert table[rank][1:] == [0, 0] and table[rank][0] == res["me"][0][1]
        peer = 1 - rank
        pid, address = results[peer]["me"][0]
        assert table[peer] == [_FakeIpc.mapped(pid, address & ~0xFFFF) + (address & 0xFFFF), 0, 0]
        assert res["opens"] == 1 and res["left_open"] == 0


def test_tensor_exchange_is_none_everywhere_when_a_rank_cannot_export(ranks) -> None:
    results = ranks(2, _tensor_exchange, (1, 1), 1)
    assert [res["table"] for res in results] == [None, None]
    assert results[0]["refusal"] == "" and "cudaIpcGetMemHandle failed" in results[1]["refusal"]


def test_tensor_exchange_names_ranks_that_disagree_on_the_call(ranks) -> None:
    for res in ranks(2, _tensor_exchange, (1, 2), -1):
        assert "ranks disagree on the call" in res["error"] and "[1, 2]" in res["error"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error path without a GPU")
def test_export_names_the_failed_call_without_a_gpu() -> None:
    pytest.importorskip("cuda.bindings.driver")
    from ep_comm.engines.cuda_ipc import CudaRuntimeIpc

    with pytest.raises(RuntimeError, match=r"^cudaSetDevice failed: cudaError"):
        CudaRuntimeIpc(0).export(0x10000)
