"""EventOverlap / EventHandle with DeepEP's meaning: a marker that an asynchronous step finished."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class EventHandle:
    """Marks a point on the current stream (a CUDA event there; already complete on CPU)."""

    def __init__(self, device: torch.device | None = None) -> None:
        device = device or (torch.device("cuda", torch.cuda.current_device())
                            if torch.cuda.is_available() else torch.device("cpu"))
        self.device = torch.device(device)
        self.event: Any = None
        if self.device.type == "cuda":
            self.event = torch.cuda.Event()
            self.event.record(torch.cuda.current_stream(self.device))

    def current_stream_wait(self) -> None:
        """Makes the current stream wait for this point (a no-op on CPU, where work is done)."""
        if self.event is not None:
            torch.cuda.current_stream(self.device).wait_event(self.event)

    def is_complete(self) -> bool:
        return True if self.event is None else bool(self.event.query())


class EventOverlap:
    """DeepEP's ``EventOverlap``: an optional event plus tensors kept alive until it completes.

    Usable as a context manager (``with event: ...``) that makes the current stream wait on exit;
    ``with event(release_handle=True): ...`` also drops the event afterwards. A hook registered
    with :meth:`register_hook_after_wait` runs once, right after the next wait (DeepEP 2.x uses it
    to order work that must follow the wait on the current stream).
    """

    def __init__(self, event: EventHandle | None = None,
                 extra_tensors: tuple[torch.Tensor, ...] | None = None) -> None:
        self.event = event
        self.extra_tensors = extra_tensors
        self.hook_after_wait: Callable[[], Any] | None = None
        self._release_handle_on_exit = False

    def current_stream_wait(self, release_handle: bool = False) -> None:
        """Waits for the event on the current stream (the event must exist).

        Args:
            release_handle: drop the event afterwards (``self.event`` becomes None), releasing
                what it keeps alive.
        """
        if self.event is None:
            raise ValueError("this EventOverlap holds no event (async_finish was False, or it was released)")
        self.event.current_stream_wait()
        hook, self.hook_after_wait = self.hook_after_wait, None
        if hook is not None:
            hook()
        if release_handle:
            self.event = None

    def register_hook_after_wait(self, hook_after_wait: Callable[[], Any]) -> None:
        """Runs ``hook_after_wait()`` once, right after the next :meth:`current_stream_wait`."""
        if self.hook_after_wait is not None:
            raise ValueError("a hook is already registered on this EventOverlap")
        self.hook_after_wait = hook_after_wait

    def __call__(self, release_handle: bool = False) -> "EventOverlap":
        """``with event(release_handle=True):`` -- the same object, releasing its event on exit."""
        self._release_handle_on_exit = release_handle
        return self

    def __enter__(self) -> "EventOverlap":
        return self

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        release, self._release_handle_on_exit = self._release_handle_on_exit, False
        if self.event is not None:
            self.current_stream_wait(release_handle=release)


def wait_previous(previous_event: EventOverlap | None) -> None:
    """Orders this call after ``previous_event`` (DeepEP's ``previous_event``)."""
    if previous_event is None:
        return
    if not isinstance(previous_event, EventOverlap):
        raise ValueError(f"previous_event must be an EventOverlap, got {type(previous_event).__name__}")
    if previous_event.event is not None:
        previous_event.event.current_stream_wait()


def finish_event(async_finish: bool, device: torch.device,
                 tensors: tuple[torch.Tensor, ...] = ()) -> EventOverlap:
    """The event a call returns: a recorded event when ``async_finish``, else an empty one."""
    if async_finish:
        return EventOverlap(EventHandle(device), tensors)
    return EventOverlap(None)
