"""A process group that serves one non-CPU device only, as NCCL/RCCL serve only the GPU, on a
machine without one.

Two parts, both confined to the process that enables them (a test's throw-away rank processes):

- **A device of tensors held in CPU memory.** :class:`DeviceTensor` is a tensor whose device is
  ``privateuseone:0`` (:data:`DEVICE`) and whose values live in an ordinary CPU tensor
  (``cpu_data``). :class:`DeviceMode` (a ``TorchDispatchMode``) runs every aten operator on those
  CPU values: factories asked for the device and operators on device tensors give device tensors,
  ``.cpu()`` / ``.to("cpu")`` give plain CPU tensors, and an operator mixing device tensors with
  CPU tensors raises as CUDA does ("Expected all tensors to be on the same device"; 0-dim CPU
  tensors and the CPU index tensors of ``tensor[index]`` are allowed, as on CUDA).
- **A group that refuses any other device.** :class:`DeviceOnlyGroup` is a ``ProcessGroup`` whose
  backend is registered for ``privateuseone`` alone (``group._device_types``), as an NCCL group's
  is for ``cuda`` alone. Every collective and point-to-point call first checks each tensor it is
  given: one on another device raises the error c10d gives an NCCL group for a CPU tensor ("No
  backend type associated with device type cpu"), before anything is sent. Accepted tensors travel
  as their CPU values over a gloo group underneath. Calls it does not implement fall to
  ``ProcessGroup``'s own, which have no backend to run on and fail.

Usage, in each rank process (after ``init_process_group``)::

    group = strict_device.new_device_only_group(world_size)
    with strict_device.DeviceMode():
        buf = ep_comm.Buffer(group, ...)        # the Buffer's device is DEVICE
        x = x_cpu.to(strict_device.DEVICE)
"""
from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

DEVICE_TYPE = "privateuseone"
DEVICE = torch.device(DEVICE_TYPE, 0)
BACKEND = "device_only"
"""The name the group's backend is registered under (what ``dist.get_backend`` reports)."""

aten = torch.ops.aten
# operators that move values between devices
_MOVES = {aten._to_copy.default, aten.copy_.default, aten._copy_from.default, aten._copy_from_and_resize.default,
          aten.lift_fresh.default, aten.lift_fresh_copy.default}
# ``tensor[index]`` and its assignment, whose index tensors (their second argument) may be on the
# CPU for a CUDA tensor
_INDEXING = {aten.index.Tensor, aten.index_put_.default, aten.index_put.default, aten._index_put_impl_.default}


class DeviceTensor(torch.Tensor):
    """A tensor on :data:`DEVICE` whose values are ``cpu_data`` (same shape, strides, dtype)."""

    cpu_data: torch.Tensor
    __torch_function__ = torch._C._disabled_torch_function_impl  # results keep their own device

    @staticmethod
    def __new__(cls, cpu_data: torch.Tensor) -> DeviceTensor:
        out = torch.Tensor._make_wrapper_subclass(cls, cpu_data.shape, strides=cpu_data.stride(),
                                                  storage_offset=cpu_data.storage_offset(),
                                                  dtype=cpu_data.dtype, device=DEVICE,
                                                  requires_grad=cpu_data.requires_grad)
        out.cpu_data = cpu_data
        return out

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _run(func, args, kwargs or {})

    def tolist(self) -> list:  # a device-to-host read, as CUDA's
        return self.cpu_data.tolist()

    def __repr__(self) -> str:  # noqa: D105 - the values, and where they are said to live
        return f"DeviceTensor({self.cpu_data!r}, device={DEVICE})"


def _on_device(value: object) -> bool:
    return isinstance(value, torch.Tensor) and value.device.type == DEVICE_TYPE


def _to_cpu(value: object) -> object:
    if isinstance(value, DeviceTensor):
        return value.cpu_data
    if isinstance(value, torch.Tensor) and value.device.type == DEVICE_TYPE:
        raise RuntimeError("a tensor on the device that holds no values (made outside DeviceMode)")
    if isinstance(value, torch.device) and value.type == DEVICE_TYPE:
        return torch.device("cpu")
    return value


def _run(func, args: tuple, kwargs: dict):
    flat, _ = tree_flatten((args, kwargs))
    tensors = [t for t in flat if isinstance(t, torch.Tensor)]
    on_device = [t for t in tensors if _on_device(t)]
    requested = kwargs.get("device")
    if requested is not None:
        wants_device = torch.device(requested).type == DEVICE_TYPE
    else:
        wants_device = bool(on_device)
    if on_device and func not in _MOVES:
        checked = tensors
        if func in _INDEXING:
            indices = {id(t) for t in tree_flatten(args[1])[0] if isinstance(t, torch.Tensor)}
            checked = [t for t in tensors if id(t) not in indices]
        stray = [t for t in checked if not _on_device(t) and t.dim() > 0]
        if stray:
            raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, "
                               f"{DEVICE} and {stray[0].device}! ({func})")
    cpu_args, cpu_kwargs = tree_map(_to_cpu, args), tree_map(_to_cpu, kwargs)
    if func in (aten._copy_from.default, aten._copy_from_and_resize.default):
        cpu_args[1].copy_(cpu_args[0])
        return args[1]
    result = func(*cpu_args, **cpu_kwargs)
    # an operator that returns one of its (CPU) arguments returns the device tensor it came from
    owners = {id(t.cpu_data): t for t in on_device if isinstance(t, DeviceTensor)}

    def rewrap(value: object) -> object:
        if not isinstance(value, torch.Tensor):
            return value
        owner = owners.get(id(value))
        if owner is not None:
            if owner.shape != value.shape:
                raise NotImplementedError(f"{func} resized a device tensor in place")
            return owner
        return DeviceTensor(value) if wants_device else value

    return tree_map(rewrap, result)


def enable_device() -> None:
    """Makes ``privateuseone`` a device torch can place tensors on (its device module, hooks and
    guard: torch's Python-backend registration, once per process)."""
    if getattr(torch, DEVICE_TYPE, None) is None:
        from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

        _setup_privateuseone_for_python_backend()


class DeviceMode(TorchDispatchMode):
    """Within it, tensors can be made on :data:`DEVICE` (factories, ``.to(DEVICE)``)."""

    def __enter__(self):
        enable_device()
        # torch.tensor(data, device=...) then builds on the CPU and moves the tensor through the
        # mode (as under FakeTensorMode), instead of below it where no kernel serves the device
        self._lifted_cpu_only = torch._C._only_lift_cpu_tensors()
        torch._C._set_only_lift_cpu_tensors(True)
        return super().__enter__()

    def __exit__(self, *exc):
        torch._C._set_only_lift_cpu_tensors(self._lifted_cpu_only)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return _run(func, args, kwargs or {})


def cpu_values(value: object) -> object:
    """``value`` with every device tensor replaced by a CPU copy (to return results from a rank)."""
    def one(v: object) -> object:
        if isinstance(v, DeviceTensor):
            return v.cpu_data.clone()
        return v
    return tree_map(one, value)


# ---- the group --------------------------------------------------------------------------------

class DeviceOnlyGroup(dist.ProcessGroup):
    """A process group for :data:`DEVICE` tensors only, over a gloo group of the same ranks.

    Attributes:
        refused: every refused call, ``(call, device type)``, in order (for tests of the group).
    """

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: timedelta) -> None:
        super().__init__(rank, size)
        self._gloo = dist.ProcessGroupGloo(store, rank, size, timeout)
        self.refused: list[tuple[str, str]] = []

    @property
    def _device_types(self) -> list[torch.device]:  # what torch's object collectives consult
        return [torch.device(DEVICE_TYPE)]

    def name(self) -> str:
        return BACKEND

    def _checked(self, call: str, *tensor_args: object) -> list:
        """``tensor_args`` with every tensor replaced by its CPU values; raises if one is not on
        the device (the check NCCL's group makes by having no CPU backend)."""
        flat, _ = tree_flatten(list(tensor_args))
        for t in flat:
            if isinstance(t, torch.Tensor) and t.device.type != DEVICE_TYPE:
                self.refused.append((call, t.device.type))
                raise RuntimeError(f"No backend type associated with device type {t.device.type} "
                                   f"({BACKEND} group, {call}: it serves {DEVICE_TYPE} only)")
        return [tree_map(_to_cpu, a) for a in tensor_args]

    # collectives
    def broadcast(self, tensors, opts=None):
        (tensors,) = self._checked("broadcast", _as_list(tensors))
        return self._gloo.broadcast(tensors, _opts(opts, c10d.BroadcastOptions))

    def allreduce(self, tensors, opts=None):
        (tensors,) = self._checked("allreduce", _as_list(tensors))
        return self._gloo.allreduce(tensors, _opts(opts, c10d.AllreduceOptions))

    def allgather(self, output_lists, input_tensors, opts=None):
        outs, ins = self._checked("allgather", output_lists, input_tensors)
        return self._gloo.allgather(outs, ins, _opts(opts, c10d.AllgatherOptions))

    def _allgather_base(self, output, input, opts=None):
        out, inp = self._checked("_allgather_base", output, input)
        return self._gloo._allgather_base(out, inp, _opts(opts, c10d.AllgatherOptions))

    def all_gather_single(self, output, input, opts=None):
        return self._allgather_base(output, input, opts)

    def gather(self, output_lists, input_tensors, opts=None):
        outs, ins = self._checked("gather", output_lists, input_tensors)
        return self._gloo.gather(outs, ins, _opts(opts, c10d.GatherOptions))

    def scatter(self, output_tensors, input_lists, opts=None):
        outs, ins = self._checked("scatter", output_tensors, input_lists)
        return self._gloo.scatter(outs, ins, _opts(opts, c10d.ScatterOptions))

    def reduce_scatter(self, output_tensors, input_lists, opts=None):
        outs, ins = self._checked("reduce_scatter", output_tensors, input_lists)
        return self._gloo.reduce_scatter(outs, ins, _opts(opts, c10d.ReduceScatterOptions))

    def alltoall_base(self, output, input, output_splits, input_splits, opts=None):
        out, inp = self._checked("alltoall_base", output, input)
        return self._gloo.alltoall_base(out, inp, list(output_splits), list(input_splits),
                                        _opts(opts, c10d.AllToAllOptions))

    def all_to_all_single(self, output, input, output_splits, input_splits, opts=None):
        return self.alltoall_base(output, input, output_splits, input_splits, opts)

    def alltoall(self, output_tensors, input_tensors, opts=None):
        outs, ins = self._checked("alltoall", output_tensors, input_tensors)
        return self._gloo.alltoall(outs, ins, _opts(opts, c10d.AllToAllOptions))

    def barrier(self, opts=None):
        return self._gloo.barrier(_opts(opts, c10d.BarrierOptions))

    # point to point
    def send(self, tensors, dst, tag=0):
        (tensors,) = self._checked("send", _as_list(tensors))
        return self._gloo.send(tensors, dst, tag)

    def recv(self, tensors, src, tag=0):
        (tensors,) = self._checked("recv", _as_list(tensors))
        return self._gloo.recv(tensors, src, tag)

    def recv_anysource(self, tensors, tag=0):
        (tensors,) = self._checked("recv_anysource", _as_list(tensors))
        return self._gloo.recv_anysource(tensors, tag)


def _as_list(tensors) -> list:
    return list(tensors) if isinstance(tensors, (list, tuple)) else [tensors]


def _opts(opts, kind):
    return opts if opts is not None else kind()


def _create(store: dist.Store, rank: int, size: int, timeout: timedelta) -> DeviceOnlyGroup:
    return DeviceOnlyGroup(store, rank, size, timeout)


def register_backend() -> None:
    """Registers :data:`BACKEND` with ``torch.distributed`` (once per process)."""
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, devices=[DEVICE_TYPE])


def new_device_only_group(world_size: int, timeout_s: float = 60.0) -> DeviceOnlyGroup:
    """A :class:`DeviceOnlyGroup` of all ``world_size`` ranks of the default group (collective)."""
    register_backend()
    group = dist.new_group(ranks=list(range(world_size)), backend=BACKEND, timeout=timedelta(seconds=timeout_s))
    if not isinstance(group, DeviceOnlyGroup):
        raise RuntimeError(f"torch.distributed made a {type(group).__name__}, not a DeviceOnlyGroup")
    return group
