"""``--max-restarts N``: what the supervisor keeps across the attempts of one job, and what the processes it starts
read of it. Each attempt's process 0 appends every finished step to a log the supervisor owns (one JSON line a step,
:data:`STEPS`); after a failure the supervisor starts every process again from the newest committed checkpoint, and
the last attempt's run record takes the steps before its checkpoint from that log (the redone steps replace the
lost ones: each step's loss once) and lists the restarts (:data:`RESTARTS`)."""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

from .job import this_process

if TYPE_CHECKING:
    from ..run.record import StepRecord

STEPS = "XBRIDGE_STEPS_LOG"       # the supervisor's file of finished steps (process 0 appends)
RESTARTS = "XBRIDGE_RESTARTS"     # the restarts before this attempt, as JSON (a list; "[]" in the first attempt)


def log_step(record: StepRecord) -> None:
    """In process 0 of a job the supervisor restarts: the finished step, appended (nothing otherwise)."""
    path = os.environ.get(STEPS)
    if path and this_process()[0] == 0:
        with open(path, "a", encoding="utf-8") as log:
            log.write(json.dumps(record.to_json()) + "\n")


def logged_steps(path: str) -> list[dict[str, Any]]:
    """Every step record in the log, the latest of each step (a redone step replaces the lost one)."""
    by_step: dict[int, dict[str, Any]] = {}
    try:
        with open(path, encoding="utf-8") as log:
            for line in log:
                try:
                    record = json.loads(line)
                except ValueError:       # a line cut short by the kill
                    continue
                by_step[int(record["step"])] = record
    except OSError:
        return []
    return [by_step[step] for step in sorted(by_step)]


def earlier_steps(start: int) -> list[StepRecord]:
    """The steps before ``start`` (this attempt's checkpoint) that earlier attempts finished: none outside a
    restarted job."""
    from ..run.record import StepRecord

    path = os.environ.get(STEPS)
    if not path or not restarts():
        return []
    return [StepRecord.from_json(record) for record in logged_steps(path) if record["step"] < start]


def restarts() -> list[dict[str, Any]]:
    """The restarts before this attempt: when (seconds since the job started), which process failed and how, the
    step it restarted from, and how many finished steps were redone."""
    text = os.environ.get(RESTARTS)
    return list(json.loads(text)) if text else []
