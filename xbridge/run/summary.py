"""What the run record says besides the steps: the step-time summary, the machine, the data sources and the peak
host memory."""

from __future__ import annotations

import os
import platform
import resource
from typing import Any

import numpy as np

from ..data.source import reproducible, tokens_per_example
from ..ir.program import Program
from ..ir.serialize import describe
from .record import RunSummary, StepRecord


def machine() -> dict[str, Any]:
    return {"platform": platform.platform(), "machine": platform.machine(), "processor": platform.processor(),
            "cpu": cpu_model(), "cpu_count": os.cpu_count(), "python": platform.python_version()}


def cpu_model() -> str | None:
    """The CPU's model name as Linux reports it (``platform.processor()`` is empty there), else None."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as handle:
            for line in handle:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    return value.strip()
    except OSError:
        pass
    return None


def summarize(program: Program, records: list[StepRecord], warmup: int) -> RunSummary:
    timed = np.array([r.time_s for r in records[warmup:]], dtype=np.float64)
    median = float(np.median(timed))
    batch = program.data.batch_size
    return RunSummary(
        compile_s=records[0].time_s, warmup_steps=warmup, timed_steps=int(timed.size),
        step_time_median_s=median, step_time_p10_s=float(np.percentile(timed, 10)),
        step_time_p90_s=float(np.percentile(timed, 90)), samples_per_s=batch / median,
        tokens_per_s=batch * tokens_per_example(program.data) / median,
        first_loss=records[0].loss, final_loss=records[-1].loss)


def data_info(program: Program) -> dict[str, Any]:
    """The run record's ``data``: each source's description, and whether the config alone identifies the data."""
    sources = {"train": describe(program.data)}
    if program.eval is not None:
        sources["eval"] = describe(program.eval.data)
    return {**sources, "reproducible": all(reproducible(d) for d in sources.values())}


def peak_rss_bytes() -> int:
    """This process's peak resident memory so far (Linux reports ``ru_maxrss`` in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
