"""``report.md``: a comparison people can read and share, from the compare record alone: what ran where (machine,
versions, command, the program's git commit), the table, how each MFU peak was obtained, the failures and the
plots. docs/results.md's comparison sections can be regenerated from it."""

from __future__ import annotations

from typing import Any

from .record import CompareRecord
from .versions import describe

__all__ = ["render"]


def _num(value: Any, spec: str, unit: str = "") -> str:
    return "-" if value is None or value != value else f"{value:{spec}}{unit}"     # None and NaN: "-"


def estimates_section(record: CompareRecord) -> list[str]:
    """The compile-only rows (--topology): compiled for a TPU slice here, nothing run; apart from the measured."""
    if not record.estimates:
        return []
    lines = ["", f"Compiled for TPU topology {record.options.topology} on this machine, not run (ESTIMATES: the "
                 "bytes and compile time are the TPU compiler's; the step time is a roofline lower bound from "
                 "datasheet peaks, the MFU the ceiling it implies):", "",
             "| target | status | chips | compile s | train step needs per chip | HBM per chip | fits | "
             "step >= ms (estimate) | MFU ceiling (estimate) |", "|" + " --- |" * 9]

    def gib(n: int | None) -> str:
        return "-" if n is None else f"{n / 2 ** 30:.2f} GiB"

    for e in record.estimates:
        fits = "-" if e.fits is None else ("yes" if e.fits else "**no**")
        lines.append(f"| {e.target} | {e.status} | {_num(e.chips, 'd')} | {_num(e.compile_s, '.1f')} | "
                     f"{gib(e.need_bytes)} | {gib(e.hbm_bytes)} | {fits} | {_num(e.step_bound_ms, '.3f')} | "
                     f"{_num(None if e.mfu_ceiling is None else 100 * e.mfu_ceiling, '.1f', '%')} |")
    lines += [f"- {e.target}: {e.error_line}" for e in record.estimates if e.status != "ok"]
    return lines


def shared_init_text(where: dict[str, str]) -> str:
    """``{"eager-cpu": "here", "xla-cpu": "xla"}`` -> ``"here: eager-cpu; xla: xla-cpu"``."""
    by_env: dict[str, list[str]] = {}
    for target, env in where.items():
        by_env.setdefault(env, []).append(target)
    return "; ".join(f"{env}: {', '.join(targets)}" for env, targets in by_env.items())


def recommendation_section(record: CompareRecord) -> list[str]:
    """The target to run, why, and its command; or why there is none (compare --no-recommend: nothing)."""
    advice = record.recommendation
    if advice is None:
        return []
    lines = ["", f"**Recommended: {advice.target or 'none'}.** {advice.reason}."]
    if advice.command:
        lines += ["", "```bash", advice.command, "```"]
    lines += [f"- not recommended: {target}, {why}" for target, why in advice.excluded.items()]
    return lines


def render(record: CompareRecord) -> str:
    options = record.options
    machine = record.machine
    provenance = record.provenance or {}
    git = provenance.get("git")
    mesh, rng = options.mesh or "as programmed", options.rng or "as programmed"
    limit = record.loss_limit
    lines = [
        f"# xbridge compare: {record.program}",
        "",
        f"- program: `{record.program_file}`, config hash `{record.config_hash}`, precision "
        f"{record.precision}, {options.devices} device(s), mesh {mesh}, "
        f"{options.steps} steps ({options.warmup} warm-up, not timed), rng {rng}",
        f"- reference (loss deviation): {record.reference}, parity limit {limit:.0e}",
        f"- machine: {machine.get('cpu') or machine.get('machine')}, {machine.get('cpu_count')} CPU cores, "
        f"{machine.get('platform')}, Python {machine.get('python')}; measured {record.measured_at}",
        f"- xbridge {record.xbridge}; FLOPs per step {record.flops_per_step:.4g} (counted on the meta device)",
    ]
    if git:
        lines.append(f"- program's repository: `{git['root']}` at commit `{git['commit'][:12]}`"
                     f"{' with uncommitted changes' if git['dirty'] else ''}")
    if provenance.get("command"):
        lines.append(f"- command: `{' '.join(provenance['command'])}`")
    lines += ["", "| target | status | compile s (cache) | step ms median (p10-p90) | tokens/s | TFLOP/s | MFU | "
                  "host RSS MiB | device peak MiB | recompiles | attention | max loss dev (step) |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    peaks: dict[str, str] = {}
    failures = []
    for row in record.targets:
        m = row.metrics
        if m is None:
            lines.append(f"| {row.target} | {row.status} | - | - | - | - | - | - | - | - | - | - |")
            failures.append((row.target, row.error_line))
            continue
        peaks[row.target] = f"{m.peak_tflops:.3g} TFLOP/s: {m.peak_source}"
        dev = "-" if m.max_loss_dev is None else f"{m.max_loss_dev:.2e} ({m.max_loss_dev_at})"
        lines.append(
            f"| {row.target} | {row.status} | {_num(m.compile_s, '.1f')} ({m.compile_cache or '-'}) | "
            f"{_num(m.step_ms_median, '.2f')} ({_num(m.step_ms_p10, '.2f')}-{_num(m.step_ms_p90, '.2f')}) | "
            f"{_num(m.tokens_per_s, ',.0f')} | {_num(m.achieved_tflops, '.3g')} | "
            f"{_num(100 * m.mfu, '.1f', '%')} | {_num(m.peak_host_rss_mib, '.0f')} | "
            f"{_num(m.device_peak_mib, '.0f')} | {_num(m.recompiles, 'd')} | {m.attention or 'unknown'} | "
            f"{dev} |")
    lines += recommendation_section(record)
    lines += ["", "MFU = achieved FLOP/s (FLOPs per step / median step time) over the peak of the devices used:"]
    lines += [f"- {target}: {source}" for target, source in peaks.items()]
    profiled = [(row.target, row.result.profile) for row in record.targets
                if row.result is not None and row.result.profile]
    for target, profile in profiled:
        lines += ["", f"Profile of {target} ({profile['steps']}): the operations that took the most time "
                      f"(trace: `{profile['traces'][0] if profile['traces'] else '-'}`)", "",
                  "| operation | total ms | calls |", "| --- | --- | --- |"]
        lines += [f"| `{op['name'][:80]}` | {op['total_ms']:.2f} | {op['calls']} |" for op in profile["top_ops"][:8]]
    lines += estimates_section(record)
    if failures:
        lines += ["", "Failed targets:"]
        lines += [f"- {target}: {error}" for target, error in failures]
    ran = [row for row in record.targets if row.result is not None]
    if ran:
        lines += ["", "Versions, per target (each ran in its own environment's interpreter):", ""]
        lines += [f"- {row.target}: " + ", ".join(f"{k} {v}" for k, v in sorted(row.result.versions.items()))
                  for row in ran if row.result is not None]
    if record.shared_init:
        lines += ["", f"The targets ran in several environments ({shared_init_text(record.shared_init)}), whose "
                      "frameworks may initialise a program's weights differently: every target started from the "
                      "weights of the interpreter that ran the compare (initial_weights.npz)."]
    if record.version_pairs:
        lines += ["", "The same target in two environments:", ""]
        lines += [f"- {describe(pair)}" for pair in record.version_pairs]
    lines += ["", "Plots: `loss_deviation.png` (each target's |loss - reference| / |reference| per step, log scale, "
                  "with the parity limit), `step_time.png` (median, p10-p90), `mfu.png`.", ""]
    return "\n".join(lines)
