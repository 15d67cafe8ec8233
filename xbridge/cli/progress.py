"""Progress on stderr while a command runs (only when stderr is a terminal and the output is for a person)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ..run.record import StepRecord


@contextlib.contextmanager
def progress_bar(enabled: bool, total: int, label: str, tokens_per_step: int = 0,
                 console: Console | None = None) -> Iterator[Callable[[int, StepRecord], None] | None]:
    """A rich progress bar on stderr when it is a terminal; otherwise nothing. Until the first step is back it says
    that the target is being prepared and compiled (the first step traces and compiles: a minute or more for a
    cold Inductor compile), with the time elapsed; then each step's loss and tokens/s."""
    if not enabled or (console is None and not sys.stderr.isatty()):
        yield None
        return
    columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("{task.fields[status]}"), TimeElapsedColumn())
    with Progress(*columns, console=console or Console(stderr=True), transient=True) as bar:
        task = bar.add_task(label, total=total, status="preparing and compiling (the first step)")

        def tick(step: int, record: StepRecord) -> None:
            rate = f", {tokens_per_step / record.time_s:,.0f} tokens/s" if tokens_per_step and record.time_s else ""
            bar.update(task, completed=step + 1, status=f"loss {record.loss:.4f}{rate}")   # step: global (resume)

        yield tick


@contextlib.contextmanager
def target_progress(enabled: bool, label: str) -> Iterator[Callable[[str, str], None] | None]:
    """A spinner on stderr (when it is a terminal) naming the target that just finished, and its status."""
    if not enabled or not sys.stderr.isatty():
        yield None
        return
    with Progress(TextColumn("[bold]{task.description}"), TextColumn("{task.fields[last]}"), TimeElapsedColumn(),
                  console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(label, total=None, last="")

        def tick(target: str, status: str) -> None:
            bar.update(task, last=f"{target}: {status}")

        yield tick
