"""``xbridge compare``: every target in its own ``xbridge run`` subprocess (xbridge/run/isolated.py), then the
derived numbers (throughput, FLOP/s, MFU, memory, loss parity), one table, JSON, CSV and plots."""

from __future__ import annotations

import csv
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import __version__
from ..errors import ConfigError
from ..ir.program import Program
from ..parity import policy
from ..run.isolated import REFERENCE, ChildOptions, TargetRun, resolve_reference, resolve_targets, run_target
from .peaks import Peak


@dataclass
class CompareOptions:
    targets: list[str] | None = None     # None: every target available here
    steps: int = 20
    warmup: int = 3
    devices: int = 1
    precision: str | None = None
    mesh: str | None = None
    timeout_s: float = 900.0
    reference: str = REFERENCE   # the eager target the loss parity column is taken against (eager-cuda on a GPU)
    rng: str | None = None       # --rng: native or portable (None: the program's own)
    remat: str | None = None     # --remat: none, full or dots (None: the program's own)
    attention: str | None = None  # --attention: the attention kernel forced (None: the program's own)
    tensorboard: Path | None = None   # --tensorboard DIR: each target's scalars under DIR/<target>
    profile: str | None = None        # --profile steps=A:B: each target's trace under runs/<target>/profile
    processes: int = 1                # --processes: jax targets as this many processes of ``devices`` each

    def __post_init__(self) -> None:
        if self.processes < 1:
            raise ConfigError(f"--processes must be >= 1, got {self.processes}")
        if self.steps < 2 or not 0 < self.warmup < self.steps:
            raise ConfigError(f"compare needs --steps >= 2 and 0 < --warmup < --steps, got {self.steps} and "
                              f"{self.warmup}")
        if self.timeout_s <= 0:
            raise ConfigError(f"--timeout must be > 0 seconds, got {self.timeout_s}")

    def child(self) -> ChildOptions:
        return ChildOptions(self.steps, self.warmup, self.devices, self.precision, self.mesh, self.timeout_s,
                            rng=self.rng, remat=self.remat, attention=self.attention, tensorboard=self.tensorboard,
                            extra=["--profile", self.profile] if self.profile else [], processes=self.processes)


@dataclass
class TargetMetrics:
    """A finished target's row of the comparison."""

    compile_s: float
    compile_cache: str | None      # warm, cold, partial, unused (CompileCache.state); None: nothing compiled
    step_ms_median: float
    step_ms_p10: float
    step_ms_p90: float
    samples_per_s: float
    tokens_per_s: float
    achieved_tflops: float
    peak_tflops: float
    mfu: float
    peak_source: str
    peak_host_rss_mib: float
    device_peak_mib: float | None
    recompiles: int | None
    final_loss: float
    max_loss_dev: float | None = None      # against the reference, when it finished
    max_loss_dev_at: str | None = None     # e.g. "step 3"
    loss_parity: bool | None = None
    final_loss_dev: float | None = None
    eval_loss: float | None = None         # the last xb.Eval loss, when the program evaluates
    attention: str | None = None           # the attention kernel(s) that ran, e.g. "flash (CPU) x4"; "-" for none
    steps_host_rss_mib: float | None = None    # what the steps added to the peak host RSS (the run's own memory)


def attention_text(kernels: dict[str, int] | None) -> str | None:
    """``{"flash (CPU)": 4}`` -> ``"flash (CPU) x4"``; no attention call -> ``"-"``; not known -> None."""
    if kernels is None:
        return None
    return ", ".join(f"{kernel} x{calls}" for kernel, calls in kernels.items()) or "-"


def _peak_for(run: TargetRun, dtype: str, cpu_peaks: dict[str, Peak]) -> tuple[Peak, int]:
    from .peaks import known_peak, measure_cpu_gemm

    assert run.result is not None
    if run.result.target.endswith("-cpu"):
        if dtype not in cpu_peaks:
            cpu_peaks[dtype] = measure_cpu_gemm(dtype)
        return cpu_peaks[dtype], 1   # virtual CPU devices share the same cores
    kind = run.result.device_kind
    peak = known_peak(kind, dtype)
    return (peak, run.devices) if peak else (Peak(float("nan"), f"unknown accelerator {kind!r}"), run.devices)


def metrics_of(program: Program, runs: list[TargetRun], flops: int,
               reference: str = REFERENCE) -> dict[str, TargetMetrics]:
    """The derived numbers of every finished target, by target: throughput, FLOP/s, MFU, memory, loss parity
    against ``reference``."""
    ref = next((r.result for r in runs if r.target == reference and r.result is not None), None)
    tol = policy.tolerance(program.precision)
    cpu_peaks: dict[str, Peak] = {}
    out: dict[str, TargetMetrics] = {}
    for run in runs:
        result = run.result
        if result is None:
            continue
        s = result.summary
        peak, devices = _peak_for(run, program.precision.compute, cpu_peaks)
        achieved = flops / s.step_time_median_s
        metrics = TargetMetrics(
            compile_s=s.compile_s, compile_cache=(result.compile_cache or {}).get("state"),
            step_ms_median=s.step_time_median_s * 1e3, step_ms_p10=s.step_time_p10_s * 1e3,
            step_ms_p90=s.step_time_p90_s * 1e3, samples_per_s=s.samples_per_s, tokens_per_s=s.tokens_per_s,
            achieved_tflops=achieved / 1e12, peak_tflops=peak.flops * devices / 1e12,
            mfu=achieved / (peak.flops * devices), peak_source=peak.source,
            peak_host_rss_mib=result.peak_host_rss_bytes / 2 ** 20,
            steps_host_rss_mib=(None if result.host_rss_before_steps_bytes is None else
                                (result.peak_host_rss_bytes - result.host_rss_before_steps_bytes) / 2 ** 20),
            device_peak_mib=result.device_peak_bytes / 2 ** 20 if result.device_peak_bytes else None,
            recompiles=s.recompiles_after_warmup, final_loss=s.final_loss,
            eval_loss=result.final_eval.loss if result.final_eval else None, attention=attention_text(s.attention))
        if ref is not None:
            losses, ref_losses = result.losses, ref.losses
            dev = policy.loss_deviation(ref_losses, losses, tol)
            metrics.max_loss_dev, metrics.max_loss_dev_at, metrics.loss_parity = dev.value, dev.where, dev.ok
            metrics.final_loss_dev = abs(losses[-1] - ref_losses[-1]) / abs(ref_losses[-1])
        out[run.target] = metrics
    return out


CSV_FIELDS = ["target", "status", "devices", *(f.name for f in dataclasses.fields(TargetMetrics)), "error"]


def write_outputs(out: Path, record: dict[str, Any]) -> list[Path]:
    from ..files import write_atomic, write_json
    from .plots import draw
    from .report import render

    paths = [write_json(out / "results.json", record)]

    def write_csv(handle: Any) -> None:
        writer = csv.DictWriter(handle, fieldnames=CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        for row in record["targets"]:
            writer.writerow({"target": row["target"], "status": row["status"], "devices": row["devices"],
                             "error": (row.get("error") or "").splitlines()[0] if row.get("error") else "",
                             **row.get("metrics", {})})

    paths.append(write_atomic(out / "results.csv", write_csv))
    paths += draw(out, record)
    paths.append(write_atomic(out / "report.md", lambda handle: handle.write(render(record))))
    return paths


def compare(program_ref: str, program: Program, options: CompareOptions, out: Path,
            progress: Callable[[str, dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Run every target, one at a time (concurrent targets would share the cores and spoil the timings), and
    return the comparison record (``results.json``): one row per target, its run record and derived metrics."""
    from ..run.loop import machine
    from ..run.provenance import provenance
    from .flops import flops_per_step

    reference = resolve_reference(options.reference)
    targets = resolve_targets(options.targets, reference)
    out.mkdir(parents=True, exist_ok=True)
    runs = []
    for target in targets:
        run = run_target(program_ref, target, options.child(), out / "runs")
        runs.append(run)
        if progress is not None:
            progress(target, run.to_json())
    flops = flops_per_step(program)
    metrics = metrics_of(program, runs, flops, reference)
    rows = []
    for run in runs:
        row = run.to_json()
        if run.target in metrics:
            row["metrics"] = dataclasses.asdict(metrics[run.target])
            row["losses"] = run.result.losses if run.result else []
        rows.append(row)
    record = {
        "xbridge": __version__, "program": program.name, "program_file": program_ref, "config": program.config(),
        "config_hash": program.config_hash, "precision": program.precision.name, "machine": machine(),
        "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "options": {k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(options).items()},
        "flops_per_step": flops, "reference": reference,
        "loss_limit": policy.tolerance(program.precision).loss_rtol, "provenance": provenance(program),
        "targets": rows,
    }
    record["written"] = [str(p) for p in write_outputs(out, record)]
    return record
