"""``--max-restarts N``: what the supervisor keeps across the attempts of one job, and what the processes it starts
read of it. Each attempt's process 0 appends every finished step to a log the supervisor owns (one JSON line a step,
:data:`STEPS`); after a failure the supervisor starts every process again from the newest committed checkpoint, and
the last attempt's run record takes the steps before its checkpoint from that log (the redone steps replace the
lost ones: each step's loss once) and lists the restarts (:data:`RESTARTS`). A process the supervisor starts writes
its one error line into :data:`ERROR_FILE` too, so a restart names what failed (an inductor rank its process 0
started, say).

Under torchrun (``torchrun --max-restarts N``) torch.distributed.elastic's agent restarts every rank itself and says
so in ``TORCHELASTIC_RESTART_COUNT``: a restarted rank resumes from the newest checkpoint of ``--checkpoint-dir``
(:func:`torchrun_resume`), and rank 0 keeps the same steps log and the restarts in that directory
(:func:`torchrun_attempt`), so its record reads as the supervisor's does."""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .job import this_process, under_torchrun

if TYPE_CHECKING:
    from ..run.record import StepRecord  # the run loop's (this package sits below the run)

STEPS = "XBRIDGE_STEPS_LOG"       # the supervisor's file of finished steps (process 0 appends)
RESTARTS = "XBRIDGE_RESTARTS"     # the restarts before this attempt, as JSON (a list; "[]" in the first attempt)
ERROR_FILE = "XBRIDGE_ERROR_FILE"     # where a started process writes its one error line (xbridge/cli/app.py)
TORCHRUN_RESTARTS = "TORCHELASTIC_RESTART_COUNT"    # set by torchrun's agent in every rank: 0, then 1, 2, ...
TORCHRUN_MAX = "TORCHELASTIC_MAX_RESTARTS"          # torchrun --max-restarts
TORCHRUN_STEPS, TORCHRUN_JOB = ".xbridge-torchrun-steps.jsonl", ".xbridge-torchrun-job.json"   # in --checkpoint-dir


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


def earlier_steps(start: int) -> list[dict[str, Any]]:
    """The steps before ``start`` (this attempt's checkpoint) that earlier attempts finished, as the step records'
    JSON: none outside a restarted job."""
    path = os.environ.get(STEPS)
    if not path or not restarts():
        return []
    return [record for record in logged_steps(path) if record["step"] < start]


def restarts() -> list[dict[str, Any]]:
    """The restarts before this attempt: when (seconds since the job started), which process failed and how, the
    step it restarted from, and how many finished steps were redone."""
    text = os.environ.get(RESTARTS)
    return list(json.loads(text)) if text else []


def end_line(log: Path) -> None:
    """A step record cut short by a kill ends its line, so the next attempt's first record starts a line of its own."""
    with contextlib.suppress(OSError):
        with open(log, "rb+") as handle:
            handle.seek(0, os.SEEK_END)
            if handle.tell():
                handle.seek(-1, os.SEEK_END)
                if handle.read(1) != b"\n":
                    handle.write(b"\n")


def torchrun_restarts() -> int:
    """How many times torchrun's agent has restarted this job's ranks (0 outside torchrun and in its first start)."""
    text = os.environ.get(TORCHRUN_RESTARTS, "0") if under_torchrun() else "0"
    return int(text) if text.isdigit() else 0


def torchrun_resume(checkpoint_dir: Path | None) -> Path | None:
    """After torchrun restarted the job: the newest committed checkpoint of ``checkpoint_dir`` to resume from (None
    in the first start, without a directory, or before its first checkpoint: then from where the command starts)."""
    if not torchrun_restarts() or checkpoint_dir is None:
        return None
    from ..checkpoint import locate
    from ..errors import CheckpointError

    with contextlib.suppress(CheckpointError):
        return locate(checkpoint_dir)
    return None


def torchrun_attempt(checkpoint_dir: Path | None, resumed: Path | None) -> None:
    """Rank 0 of a job torchrun may restart (``--max-restarts`` > 0) with a ``--checkpoint-dir``: its finished steps
    go to a log in that directory (started empty in the job's first start) and, after a restart, this attempt's
    record takes the earlier steps from it and lists the restarts (when, from which step, how many steps were redone;
    which rank failed and how is in torchrun's own output, which the ranks do not see)."""
    maximum = os.environ.get(TORCHRUN_MAX, "0")
    if not under_torchrun() or os.environ.get("RANK") != "0" or checkpoint_dir is None or not maximum.isdigit() \
            or int(maximum) == 0:
        return
    steps, job_file = checkpoint_dir / TORCHRUN_STEPS, checkpoint_dir / TORCHRUN_JOB
    count = torchrun_restarts()
    job: dict[str, Any] = {"began": time.time(), "restarts": []}
    if count == 0:
        checkpoint_dir.mkdir(parents=True, exist_ok=True)
        steps.write_text("", encoding="utf-8")
    else:
        with contextlib.suppress(OSError, ValueError):
            job = json.loads(job_file.read_text(encoding="utf-8"))
        end_line(steps)
        finished = [record["step"] for record in logged_steps(str(steps))]
        from_step = int(resumed.name.rpartition("-")[2]) if resumed is not None else 0
        reached = max(finished) + 1 if finished else 0
        job["restarts"].append({"after_s": round(time.time() - job["began"], 1), "process": None, "status": None,
                                "message": f"torchrun restarted the job ({TORCHRUN_RESTARTS}={count})",
                                "from_step": from_step, "steps_redone": max(reached - from_step, 0)})
    job_file.write_text(json.dumps(job), encoding="utf-8")
    os.environ[STEPS] = str(steps)
    os.environ[RESTARTS] = json.dumps(job["restarts"])
