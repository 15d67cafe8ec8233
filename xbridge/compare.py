"""``xbridge compare``: every target in its own ``xbridge run`` subprocess, then one table, JSON, CSV and plots.

Process isolation is the point: runtimes and their environment (``XLA_FLAGS``, ``PJRT_DEVICE``,
``CPU_NUM_DEVICES``) are per process, and a target that crashes, hangs or runs out of memory is reported in its own
row (with the tail of its stderr) while the others complete.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from . import __version__, parity, registry
from .errors import ConfigError
from .program import Program

REFERENCE = "eager-cpu"


@dataclass
class CompareOptions:
    targets: list[str] | None = None     # None: every target available here
    steps: int = 20
    warmup: int = 3
    devices: int = 1
    precision: str | None = None
    mesh: str | None = None
    timeout_s: float = 900.0
    extra: dict[str, list[str]] = field(default_factory=dict)   # per-target extra CLI arguments

    def __post_init__(self) -> None:
        if self.steps < 2 or not 0 < self.warmup < self.steps:
            raise ConfigError(f"compare needs --steps >= 2 and 0 < --warmup < --steps, got {self.steps} and {self.warmup}")
        if self.timeout_s <= 0:
            raise ConfigError(f"--timeout must be > 0 seconds, got {self.timeout_s}")


def available_targets() -> list[str]:
    rows = [r["target"] for r in registry.describe() if r["available"]]
    return sorted(rows, key=lambda t: (t != REFERENCE, t))


def split_variant(entry: str) -> tuple[str, list[str]]:
    """``TARGET[:OPTION=VALUE...]`` (e.g. ``xla-cpu:xla-mode=openxla``) -> the target and its ``run`` flags, so
    one compare can race two ways of reaching the same compiler. Options are checked against the backend's."""
    target_text, *parts = entry.split(":")
    target, backend = registry.resolve(target_text)
    args: list[str] = []
    for part in parts:
        name, sep, value = part.partition("=")
        if not sep or not name or not value:
            raise ConfigError(f"target variant {entry!r}: {part!r} is not OPTION=VALUE (e.g. xla-cpu:xla-mode=openxla)")
        if name.replace("-", "_") not in backend.options:
            raise ConfigError(f"target variant {entry!r}: target {target} takes no --{name} (it takes: "
                              f"{', '.join('--' + o.replace('_', '-') for o in backend.options) or 'no options'})")
        args += [f"--{name}", value]
    return str(target), args


def resolve_targets(requested: list[str] | None) -> list[str]:
    targets = available_targets()
    if requested:   # canonical target names, variants kept: "xla:xla-mode=openxla" -> "xla-cpu:xla-mode=openxla"
        targets = [":".join([split_variant(entry)[0], *entry.split(":")[1:]]) for entry in requested]
    seen = list(dict.fromkeys(targets))
    if REFERENCE not in seen:
        seen.insert(0, REFERENCE)     # the baseline of loss parity
    return seen


def worker_command(program_ref: str, target: str, options: CompareOptions, devices: int, out: Path) -> list[str]:
    target_text, variant = split_variant(target)
    cmd = [sys.executable, "-m", "xbridge", "run", program_ref, "--backend", target_text, *variant, "--steps",
           str(options.steps), "--warmup", str(options.warmup), "--devices", str(devices), "--format", "json",
           "--out", str(out)]
    if options.precision:
        cmd += ["--precision", options.precision]
    if options.mesh:
        cmd += ["--mesh", options.mesh]
    return cmd + options.extra.get(target, [])


def _tail(text: str, lines: int = 12) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def run_target(program_ref: str, target: str, options: CompareOptions, out: Path) -> dict[str, Any]:
    """One target in a fresh interpreter; a failure, a timeout or a kill becomes the row's status."""
    _, backend = registry.resolve(split_variant(target)[0])
    devices = options.devices if backend.sharded else 1
    cmd = worker_command(program_ref, target, options, devices, out / target)
    row: dict[str, Any] = {"target": target, "devices": devices, "command": cmd}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=options.timeout_s,
                              env={**os.environ, "XBRIDGE_DEBUG": "0"})
    except subprocess.TimeoutExpired as exc:
        stderr = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        return row | {"status": "timeout", "error": f"no result after {options.timeout_s:g} s\n{_tail(stderr)}"}
    if proc.returncode != 0:
        reason = f"exit code {proc.returncode}" if proc.returncode > 0 else f"killed by signal {-proc.returncode}"
        return row | {"status": "failed", "error": f"{reason}\n{_tail(proc.stderr)}"}
    try:
        result = json.loads(proc.stdout)
    except json.JSONDecodeError:
        return row | {"status": "failed", "error": f"no JSON result on stdout\n{_tail(proc.stderr)}"}
    return row | {"status": "ok", "result": result}


def _peak_for(row: dict[str, Any], dtype: str, cpu_peaks: dict[str, Any]) -> Any:
    from .peaks import Peak, known_peak, measure_cpu_gemm

    result = row["result"]
    kind = result.get("device_kind", "cpu")
    if result["target"].endswith("-cpu"):
        if dtype not in cpu_peaks:
            cpu_peaks[dtype] = measure_cpu_gemm(dtype)
        return cpu_peaks[dtype], 1   # virtual CPU devices share the same cores
    peak = known_peak(kind, dtype)
    return (peak, row["devices"]) if peak else (Peak(float("nan"), f"unknown accelerator {kind!r}"), row["devices"])


def summarize(program: Program, rows: list[dict[str, Any]], flops: int) -> None:
    """Add the derived numbers to each row in place: throughput, FLOP/s, MFU, memory, loss parity."""
    ref = next((r for r in rows if r["target"] == REFERENCE and r["status"] == "ok"), None)
    ref_losses = [s["loss"] for s in ref["result"]["steps"]] if ref else None
    tol = parity.tolerance(program.precision)
    cpu_peaks: dict[str, Any] = {}
    for row in rows:
        if row["status"] != "ok":
            continue
        result = row["result"]
        s = result["summary"]
        peak, devices = _peak_for(row, program.precision.compute, cpu_peaks)
        achieved = flops / s["step_time_median_s"]
        losses = [step["loss"] for step in result["steps"]]
        metrics = {
            "compile_s": s["compile_s"], "step_ms_median": s["step_time_median_s"] * 1e3,
            "step_ms_p10": s["step_time_p10_s"] * 1e3, "step_ms_p90": s["step_time_p90_s"] * 1e3,
            "samples_per_s": s["samples_per_s"], "tokens_per_s": s["tokens_per_s"],
            "achieved_tflops": achieved / 1e12, "peak_tflops": peak.flops * devices / 1e12,
            "mfu": achieved / (peak.flops * devices), "peak_source": peak.source,
            "peak_host_rss_mib": result.get("peak_host_rss_bytes", 0) / 2 ** 20,
            "device_peak_mib": (result["device_peak_bytes"] / 2 ** 20) if result.get("device_peak_bytes") else None,
            "recompiles": s["recompiles_after_warmup"], "final_loss": s["final_loss"],
        }
        if ref_losses is not None:
            dev = parity.loss_deviation(ref_losses, losses, tol)
            metrics |= {"max_loss_dev": dev.value, "max_loss_dev_at": dev.where, "loss_parity": dev.ok,
                        "final_loss_dev": abs(losses[-1] - ref_losses[-1]) / abs(ref_losses[-1])}
        row["metrics"] = metrics
        row["losses"] = losses


CSV_FIELDS = ["target", "status", "devices", "compile_s", "step_ms_median", "step_ms_p10", "step_ms_p90",
              "samples_per_s", "tokens_per_s", "achieved_tflops", "peak_tflops", "mfu", "peak_host_rss_mib",
              "device_peak_mib", "recompiles", "final_loss", "max_loss_dev", "max_loss_dev_at", "loss_parity",
              "final_loss_dev", "peak_source", "error"]


def write_outputs(out: Path, record: dict[str, Any]) -> list[Path]:
    from .report import write_atomic, write_json

    paths = [write_json(out / "results.json", record)]

    def write_csv(handle: Any) -> None:
        writer = csv.DictWriter(handle, fieldnames=CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        for row in record["targets"]:
            writer.writerow({"target": row["target"], "status": row["status"], "devices": row["devices"],
                             "error": (row.get("error") or "").splitlines()[0] if row.get("error") else "",
                             **row.get("metrics", {})})

    paths.append(write_atomic(out / "results.csv", write_csv))
    from .plots import draw

    paths += draw(out, record)
    return paths


def compare(program_ref: str, program: Program, options: CompareOptions, out: Path,
            progress: Callable[[str, dict[str, Any]], None] | None = None) -> dict[str, Any]:
    from .flops import flops_per_step
    from .runloop import machine

    targets = resolve_targets(options.targets)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for target in targets:   # one at a time: concurrent targets would share the cores and spoil the timings
        row = run_target(program_ref, target, options, out / "runs")
        rows.append(row)
        if progress is not None:
            progress(target, row)
    flops = flops_per_step(program)
    summarize(program, rows, flops)
    record = {
        "xbridge": __version__, "program": program.name, "program_file": program_ref, "config": program.config(),
        "config_hash": program.config_hash, "precision": program.precision.name, "machine": machine(),
        "options": {k: v for k, v in asdict(options).items() if k != "extra"}, "flops_per_step": flops,
        "reference": REFERENCE, "targets": rows,
    }
    record["written"] = [str(p) for p in write_outputs(out, record)]
    return record
