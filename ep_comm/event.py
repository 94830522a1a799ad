"""EventOverlap / EventHandle with DeepEP's meaning: a marker that an asynchronous step finished."""
from __future__ import annotations

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

    Usable as a context manager (``with event: ...``) that waits on exit.
    """

    def __init__(self, event: EventHandle | None = None,
                 extra_tensors: tuple[torch.Tensor, ...] | None = None) -> None:
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        """Waits for the event on the current stream (the event must exist)."""
        if self.event is None:
            raise ValueError("this EventOverlap holds no event (async_finish was False)")
        self.event.current_stream_wait()

    def __enter__(self) -> "EventOverlap":
        return self

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        if self.event is not None:
            self.event.current_stream_wait()


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
