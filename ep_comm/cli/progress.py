"""The progress bar rank 0 shows while the ranks run (rich; silent when disabled)."""
from __future__ import annotations

from types import TracebackType

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


class ProgressBar:
    """A context manager; calling it as ``bar(description, done, total)`` updates the bar."""

    def __init__(self, enabled: bool, console: Console | None = None) -> None:
        self.enabled = enabled
        self._progress: Progress | None = None
        self._task = None
        self._console = console or Console(stderr=True)

    def __enter__(self) -> "ProgressBar":
        if self.enabled:
            self._progress = Progress(TextColumn("[bold]ep-bench[/]"), BarColumn(), MofNCompleteColumn(),
                                      TimeElapsedColumn(), TextColumn("{task.description}"),
                                      console=self._console, transient=True)
            self._progress.start()
            self._task = self._progress.add_task("starting", total=1)
        return self

    def __call__(self, description: str, done: int, total: int) -> None:
        if self._progress is not None:
            self._progress.update(self._task, description=description, completed=done, total=total)

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
