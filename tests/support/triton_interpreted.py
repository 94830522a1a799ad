"""A worker process whose Triton kernels run under Triton's interpreter, for CPU tests of
``ep_comm.row_kernels``.

Triton reads ``TRITON_INTERPRET`` (through ``triton.knobs``, from the environment at each access)
when ``@triton.jit`` decorates a function, and that includes the functions of ``triton.language``
itself (``tl.max``, ...), decorated when ``triton.language`` is first imported. So it must be set
before the process imports Triton, and a pytest process may already have imported Triton with
compiled kernels (the ahead-of-time compile tests, Megatron's modules). The worker is a fresh
spawned process with ``TRITON_INTERPRET=1`` in its environment from the start: tests send it
module-level functions and get back their results, or their exception with its traceback.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import queue
import traceback
from collections.abc import Callable
from typing import Any


class InterpretedTaskError(AssertionError):
    """A task raised in the worker: the message holds its traceback."""


def _serve(tasks: Any, results: Any) -> None:
    import torch
    import triton
    from triton.runtime.interpreter import InterpretedFunction

    torch.set_num_threads(1)
    from ep_comm.row_kernels import reduce

    if not (triton.knobs.runtime.interpret and isinstance(reduce.sum_rows_kernel, InterpretedFunction)):
        results.put((False, "the worker's kernels are not interpreted (TRITON_INTERPRET was not read)"))
        return
    results.put((True, "ready"))
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args = task
        try:
            results.put((True, fn(*args)))
        except BaseException as error:  # noqa: BLE001 - reported to the parent
            results.put((False, f"{type(error).__name__}: {error}\n{traceback.format_exc()}"))


class InterpreterWorker:
    """One spawned process running tasks under Triton's interpreter until closed."""

    def __init__(self, start_timeout: float = 120.0) -> None:
        ctx = mp.get_context("spawn")
        self._tasks = ctx.Queue()
        self._results = ctx.Queue()
        previous = os.environ.get("TRITON_INTERPRET")
        os.environ["TRITON_INTERPRET"] = "1"  # the child's environment is copied at start()
        try:
            self._proc = ctx.Process(target=_serve, args=(self._tasks, self._results), daemon=True)
            self._proc.start()
        finally:
            if previous is None:
                del os.environ["TRITON_INTERPRET"]
            else:
                os.environ["TRITON_INTERPRET"] = previous
        ok, message = self._get(start_timeout)
        if not ok:
            self.close()
            raise InterpretedTaskError(message)

    def _get(self, timeout: float) -> tuple[bool, Any]:
        try:
            return self._results.get(timeout=timeout)
        except queue.Empty:
            self.close()
            raise InterpretedTaskError(f"the interpreter worker gave no answer within {timeout} s") from None

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 600.0) -> Any:
        """``fn(*args)`` in the worker (``fn`` a module-level function); its result, or
        :class:`InterpretedTaskError` with the worker's traceback."""
        if not self._proc.is_alive():
            raise InterpretedTaskError("the interpreter worker is not running")
        self._tasks.put((fn, args))
        ok, value = self._get(timeout)
        if not ok:
            raise InterpretedTaskError(value)
        return value

    def close(self) -> None:
        if self._proc.is_alive():
            self._tasks.put(None)
            self._proc.join(timeout=5)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(timeout=5)
