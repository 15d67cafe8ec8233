"""``--profile steps=A:B``: a trace of steps A..B-1 from each stack's own profiler, and a summary read back from it.

The backends write Chrome/Perfetto trace JSON: torch.profiler's ``export_chrome_trace`` (eager, inductor), and
the ``<host>.trace.json.gz`` that ``jax.profiler`` and torch_xla's profiler write next to their ``.xplane.pb``
(under ``plugins/profile/<time>/``, the layout TensorBoard's profile plugin and xprof open). One reader summarises
them all: the operations that took the most time, and host versus device time per profiled step where the trace
has device lanes. Importing this module imports no ML framework."""

from __future__ import annotations

import gzip
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..contract.capabilities import STEP_MARK
from ..errors import ConfigError

__all__ = ["ProfileSpec", "find_traces", "summarise"]

_SPEC = re.compile(r"^steps=(\d+):(\d+)$")
_DEVICE_LANE = re.compile(r"(/device:|gpu|cuda|tpu|stream)", re.IGNORECASE)


@dataclass(frozen=True)
class ProfileSpec:
    start: int       # the first profiled step (0-based, as run.json numbers them)
    stop: int        # one past the last

    @classmethod
    def parse(cls, text: str, steps: int) -> ProfileSpec:
        match = _SPEC.match(text.strip())
        if match is None:
            raise ConfigError(f"--profile {text!r} is not steps=A:B (e.g. --profile steps=5:8: steps 5, 6 and 7)")
        start, stop = int(match.group(1)), int(match.group(2))
        if not start < stop <= steps:
            raise ConfigError(f"--profile {text!r}: the steps must satisfy A < B <= --steps ({steps})")
        return cls(start, stop)

    def __str__(self) -> str:
        return f"steps={self.start}:{self.stop}"


def find_traces(directory: Path) -> list[Path]:
    """The Chrome trace files under ``directory`` (``*.json``, ``*.trace.json.gz``, ``*.pt.trace.json``)."""
    found = [p for p in directory.rglob("*") if p.is_file() and (p.name.endswith(".trace.json.gz")
                                                                or p.name.endswith(".json"))]
    return sorted(found)


def _events(path: Path) -> list[dict[str, Any]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as handle:
        data = json.load(handle)
    events = data.get("traceEvents", []) if isinstance(data, dict) else data
    return [e for e in events if isinstance(e, dict)]


def summarise(directory: Path, spec: ProfileSpec, top: int = 10) -> dict[str, Any]:
    """What the traces under ``directory`` say: the files, the profiled steps' wall time (from the step marks),
    the ``top`` operations by total time (Python frames left out), and host/device time per step."""
    traces = find_traces(directory)
    if not traces:
        return {"traces": [], "steps": str(spec), "top_ops": [], "note": "the profiler wrote no trace file"}
    lanes: dict[tuple[Any, Any], str] = {}
    totals: dict[str, list[float]] = {}
    marks: list[tuple[int, float]] = []
    host_us = device_us = 0.0
    for path in traces:
        events = _events(path)
        for e in events:
            if e.get("ph") == "M" and e.get("name") in ("process_name", "thread_name"):
                lanes[(e.get("pid"), e.get("tid") if e["name"] == "thread_name" else None)] = \
                    str(e.get("args", {}).get("name", ""))
        for e in events:
            if e.get("ph") != "X" or "dur" not in e:
                continue
            name, dur = str(e.get("name", "")), float(e["dur"])
            if name.startswith(STEP_MARK):     # torch: "xbridge step 5"; jax: "xbridge step" with step_num 5
                number = name[len(STEP_MARK):].strip() or str(e.get("args", {}).get("step_num", ""))
                marks.append((int(number) if number.isdigit() else -1, dur))
                continue
            if (name.startswith(("$", "<built-in", "PyTorch Profiler")) or e.get("cat") == "python_function"):
                continue        # Python frames, and torch.profiler's own span over the whole trace
            lane = lanes.get((e.get("pid"), None), "") + " " + lanes.get((e.get("pid"), e.get("tid")), "")
            on_device = bool(_DEVICE_LANE.search(lane)) or e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
            if on_device:
                device_us += dur
            else:
                host_us += dur
            entry = totals.setdefault(name, [0.0, 0])
            entry[0] += dur
            entry[1] += 1
    steps = spec.stop - spec.start
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]
    return {
        "traces": [str(p) for p in traces],
        "steps": str(spec),
        "marked_steps": [step for step, _ in sorted(marks)],      # the steps the trace marks (torch and jax)
        "step_ms": [round(d / 1e3, 3) for _, d in sorted(marks)],
        "top_ops": [{"name": name, "total_ms": round(total / 1e3, 3), "calls": int(calls)}
                    for name, (total, calls) in ranked],
        # events nest (a kernel inside its op inside its module), so these sums count nested time more than once:
        # compare them between targets and steps, not with the wall time
        "host_event_ms_per_step": round(host_us / 1e3 / steps, 3),
        "device_event_ms_per_step": round(device_us / 1e3 / steps, 3) if device_us else None,
    }
