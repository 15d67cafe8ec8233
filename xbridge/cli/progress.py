"""Progress on stderr while a command runs (only when stderr is a terminal and the output is for a person)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ..run.record import StepRecord


@contextlib.contextmanager
def progress_bar(enabled: bool, total: int, label: str) -> Iterator[Callable[[int, StepRecord], None] | None]:
    """A rich progress bar on stderr when it is a terminal; otherwise nothing."""
    if not enabled or not sys.stderr.isatty():
        yield None
        return
    columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("loss {task.fields[loss]}"), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(label, total=total, loss="-")

        def tick(step: int, record: StepRecord) -> None:
            bar.update(task, completed=step + 1, loss=f"{record.loss:.4f}")   # step: global (resume)

        yield tick


@contextlib.contextmanager
def target_progress(enabled: bool, label: str) -> Iterator[Callable[[str, dict[str, Any]], None] | None]:
    """A spinner on stderr (when it is a terminal) naming the target that just finished."""
    if not enabled or not sys.stderr.isatty():
        yield None
        return
    with Progress(TextColumn("[bold]{task.description}"), TextColumn("{task.fields[last]}"), TimeElapsedColumn(),
                  console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(label, total=None, last="")

        def tick(target: str, row: dict[str, Any]) -> None:
            bar.update(task, last=f"{target}: {row['status']}")

        yield tick
