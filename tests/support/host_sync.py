"""Host-synchronisation detector for CPU tests of code meant to run on a GPU without host round
trips (CUDA-graph capturable calls).

Device tensors are stood in for by :class:`DeviceTensor`, a wrapper holding CPU data that reports
the ``meta`` device (a non-CPU device type whose device guard works without a GPU, so indexing
and the other C++ entry points behave as on a real accelerator). Inside :func:`watch`:

- factory calls given ``device=DEVICE`` and ops on device tensors produce device tensors (their
  data computed on the CPU);
- every op that makes the host wait for a device value is recorded with the ep_comm source line
  that issued it: reading a value (``item``, ``int()``/``bool()``/``float()`` of a tensor,
  ``tolist``, ``numpy``, ``_local_scalar_dense``, ``equal``, ``is_nonzero``), outputs whose size
  depends on the data (``nonzero``, ``masked_select``, boolean-mask indexing and assignment,
  ``bincount``, ``unique``, ``repeat_interleave`` without ``output_size``), and device-to-host
  copies (``.cpu()``, ``.to("cpu")``, a blocking ``copy_`` into a host tensor). A
  ``copy_(..., non_blocking=True)`` into a host tensor is an asynchronous copy (pinned memory on
  a GPU) and is not a wait;
- ``torch.cuda`` stream/event waits (``synchronize``, ``Event.query``/``synchronize``,
  ``current_stream``) are recorded too.

The watched code keeps running after a record (the value is computed on the CPU), so one run
lists every synchronisation it makes.
"""
from __future__ import annotations

import contextlib
import traceback
from dataclasses import dataclass, field
from unittest import mock

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

DEVICE = torch.device("meta")
"""The device the stand-in device tensors report."""

_aten = torch.ops.aten
_READS = {_aten._local_scalar_dense.default, _aten.equal.default, _aten.is_nonzero.default}
_DATA_SIZED = {_aten.nonzero.default, _aten.masked_select.default, _aten.bincount.default,
               _aten._unique2.default, _aten.unique_dim.default, _aten.unique_consecutive.default,
               _aten.repeat_interleave.Tensor}
_HOST_METHODS = {torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.item, torch.Tensor.__bool__,
                 torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__}


class DeviceTensor(torch.Tensor):
    """A tensor 'on the device': CPU data in ``inner``, ``device`` reported as :data:`DEVICE`."""

    inner: torch.Tensor

    @staticmethod
    def __new__(cls, inner: torch.Tensor):
        t = torch.Tensor._make_wrapper_subclass(cls, inner.shape, strides=inner.stride(),
                                                storage_offset=inner.storage_offset(), dtype=inner.dtype,
                                                device=DEVICE, requires_grad=False)
        t.inner = inner
        return t

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _run(func, args, kwargs or {}, None)

    def __repr__(self) -> str:
        return f"DeviceTensor({self.inner!r})"


def to_device(t: torch.Tensor) -> DeviceTensor:
    """``t`` (CPU) as a device tensor (a copy)."""
    return DeviceTensor(t.clone())


def to_host(t: object) -> object:
    """The CPU data of a device tensor (other values unchanged; tuples element-wise)."""
    if isinstance(t, tuple):
        return tuple(to_host(v) for v in t)
    return t.inner if isinstance(t, DeviceTensor) else t


@dataclass
class SyncLog:
    """Every host synchronisation seen: ``(what, where)`` with ``where`` the ep_comm source line."""

    found: list[tuple[str, str]] = field(default_factory=list)

    def add(self, what: str) -> None:
        self.found.append((what, _caller()))

    def __str__(self) -> str:
        return "\n".join(f"  {what} at {where}" for what, where in self.found) or "  (none)"


def _caller() -> str:
    for frame in reversed(traceback.extract_stack()[:-2]):
        if "/ep_comm/" in frame.filename:
            path = frame.filename[frame.filename.rindex("/ep_comm/") + 1:]
            return f"{path}:{frame.lineno} ({frame.line})"
    return "outside ep_comm"


def _is_bool_index(t: object) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8)


def _sync_of(func, args, kwargs) -> str | None:
    """Why ``func`` on these arguments makes the host wait (None: it does not)."""
    on_device = any(isinstance(a, DeviceTensor) for a in tree_flatten_all((args, kwargs)))
    if not on_device:
        return None
    if func in _READS or func in _DATA_SIZED:
        if func is _aten.repeat_interleave.Tensor and kwargs.get("output_size") is not None:
            return None
        return str(func)
    if func in (_aten.index.Tensor, _aten.index_put_.default, _aten.index_put.default):
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        if any(_is_bool_index(i) for i in indices if i is not None):
            return f"{func} with a boolean mask"
    if func is _aten._to_copy.default:
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cpu" and isinstance(args[0], DeviceTensor):
            return "device-to-host copy (.cpu() / .to('cpu'))"
    if func is _aten.copy_.default:
        dst, src = args[0], args[1]
        non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
        if not isinstance(dst, DeviceTensor) and isinstance(src, DeviceTensor) and not non_blocking:
            return "blocking device-to-host copy_"
    return None


def tree_flatten_all(obj: object) -> list[object]:
    out: list[object] = []
    tree_map(out.append, obj)
    return out


_log: list[SyncLog] = []


def _run(func, args, kwargs, log: SyncLog | None):
    if log is None and _log:
        log = _log[-1]
    why = _sync_of(func, args, kwargs)
    if why is not None and log is not None:
        log.add(why)
    made_on_device = [False]

    def unwrap(a):
        if isinstance(a, DeviceTensor):
            made_on_device[0] = True
            return a.inner
        if isinstance(a, torch.device) and a.type == DEVICE.type:
            made_on_device[0] = True
            return torch.device("cpu")
        return a

    plain_args, plain_kwargs = tree_map(unwrap, args), tree_map(unwrap, kwargs)
    device_kwarg = kwargs.get("device")
    if device_kwarg is not None and torch.device(device_kwarg).type == "cpu":
        made_on_device[0] = False  # an explicit copy to the host
    out = func(*plain_args, **plain_kwargs)
    if func is _aten.copy_.default and not isinstance(args[0], DeviceTensor):
        return args[0]
    if func._schema.returns and any(r.alias_info is not None and r.alias_info.is_write for r in func._schema.returns):
        return args[0]  # in-place: the wrapper of the mutated tensor
    if not made_on_device[0]:
        return out
    return tree_map(lambda o: DeviceTensor(o) if isinstance(o, torch.Tensor) else o, out)


class _DispatchMode(TorchDispatchMode):
    def __init__(self, log: SyncLog) -> None:
        super().__init__()
        self.log = log

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return _run(func, args, kwargs or {}, self.log)


class _FunctionMode(TorchFunctionMode):
    def __init__(self, log: SyncLog) -> None:
        super().__init__()
        self.log = log

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _HOST_METHODS and args and isinstance(args[0], DeviceTensor):
            self.log.add(f"Tensor.{func.__name__}")
            with torch._C.DisableTorchFunction():
                return func(args[0].inner, *args[1:], **kwargs)
        return func(*args, **kwargs)


class _Stream:
    def __init__(self, log: SyncLog) -> None:
        self.log = log
        self.cuda_stream = 0

    def synchronize(self) -> None:
        self.log.add("torch.cuda stream synchronize")

    def wait_event(self, event: object) -> None:
        pass

    def wait_stream(self, stream: object) -> None:
        pass


class _Event:
    def __init__(self, log: SyncLog) -> None:
        self.log = log

    def record(self, stream: object = None) -> None:
        pass

    def query(self) -> bool:
        self.log.add("torch.cuda.Event.query (host polling)")
        return True

    def synchronize(self) -> None:
        self.log.add("torch.cuda.Event.synchronize")

    def wait(self, stream: object = None) -> None:
        pass


@contextlib.contextmanager
def watch(capturing: bool = False):
    """Records every host synchronisation inside the block into the yielded :class:`SyncLog`.
    ``torch.cuda.is_current_stream_capturing()`` answers ``capturing`` meanwhile."""
    log = SyncLog()
    _log.append(log)
    patches = [
        mock.patch.object(torch.cuda, "synchronize", lambda *a, **k: log.add("torch.cuda.synchronize")),
        mock.patch.object(torch.cuda, "current_stream", lambda *a, **k: _Stream(log)),
        mock.patch.object(torch.cuda, "Event", lambda *a, **k: _Event(log)),
        mock.patch.object(torch.cuda, "is_current_stream_capturing", lambda: capturing),
    ]
    try:
        with contextlib.ExitStack() as stack:
            for p in patches:
                stack.enter_context(p)
            stack.enter_context(_FunctionMode(log))
            stack.enter_context(_DispatchMode(log))
            yield log
    finally:
        _log.pop()
