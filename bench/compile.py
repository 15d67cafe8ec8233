"""Compile time, cold and warm, per backend and program.

    .venv/bin/python bench/compile.py [--programs gpt,mlp] [--backends inductor-cpu,jax-cpu,xla-cpu]
                                      [--rng native,portable] [--out bench/results/compile]

For each program and target: one `xbridge run --steps 5 --warmup 2` in a fresh process with an empty cache folder
(cold), then another fresh process on the same folder (warm), as a user's first and second run. Reported per run:
the first step (tracing, compilation or cache load, and one step of compute: what `compare` shows as compile time),
the steady step time measured in the same run, the compile overhead (the two warm-up steps minus two steady steps:
torch_xla compiles a second graph at step 1), the persistent-cache hits and misses, the backend's own compile
phases, the process's wall time, and the cache folder's size. Prints a table, writes compile.json. A program is a
name in programs/ or a path (tests/fixtures/transformer_encoder.py); ``--rng`` runs each under each generator (what
portable randomness adds to a compile: bench/results/compile/NOTES.md).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from machine import cpu, describe  # noqa: E402


def program_path(program: str) -> str:
    return program if program.endswith(".py") or ":" in program else str(ROOT / "programs" / f"{program}.py")


def one_run(program: str, target: str, cache: Path, rng: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "JAX_COMPILATION_CACHE_DIR")}
    env["XBRIDGE_CACHE_DIR"] = str(cache)
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "xbridge", "run", program_path(program),
                           "--backend", target, "--steps", "5", "--warmup", "2", "--format", "json",
                           *(["--rng", rng] if rng else [])],
                          capture_output=True, text=True, env=env, cwd=ROOT)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["?"])[-1], "wall_s": wall}
    record = json.loads(proc.stdout)
    summary, cache_info = record["summary"], record["compile_cache"] or {}
    size = sum(p.stat().st_size for p in cache.rglob("*") if p.is_file())
    return {"first_step_s": summary["compile_s"], "step_s": summary["step_time_median_s"],
            "compile_overhead_s": sum(s["time_s"] for s in record["steps"][:2]) - 2 * summary["step_time_median_s"],
            "wall_s": wall,
            "cache_state": cache_info.get("state"), "hits": cache_info.get("hits"),
            "misses": cache_info.get("misses"), "phases_s": cache_info.get("seconds", {}), "cache_bytes": size}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--programs", default="gpt,mlp")
    parser.add_argument("--backends", default="inductor-cpu,jax-cpu,xla-cpu")
    parser.add_argument("--rng", default="", help="comma-separated --rng values (default: the program's own)")
    parser.add_argument("--out", default=str(HERE / "results" / "compile"))
    args = parser.parse_args()
    rows = []
    print(f"on {cpu()}, {os.cpu_count()} cores", flush=True)
    print(f"{'program':<20}{'target':<14}{'rng':<9}{'run':<6}{'first step s':>13}{'step s':>8}{'overhead s':>11}"
          f"{'wall s':>8}{'cache':>9}{'hits':>6}{'misses':>7}{'cache MiB':>10}", flush=True)
    runs = [(program, target, rng) for program in [p.strip() for p in args.programs.split(",") if p.strip()]
            for target in [t.strip() for t in args.backends.split(",") if t.strip()]
            for rng in [r.strip() for r in args.rng.split(",")]]
    for program, target, rng in runs:
        name, shown = program.rpartition(":")[2] if ":" in program else Path(program).stem, rng or "-"
        with tempfile.TemporaryDirectory(prefix="xbridge-bench-compile-") as folder:
            for run in ("cold", "warm"):
                row = {"program": program, "target": target, "rng": rng or None, "run": run, "cpu": cpu(),
                       **one_run(program, target, Path(folder), rng or None)}
                rows.append(row)
                if "error" in row:
                    print(f"{name:<20}{target:<14}{shown:<9}{run:<6} error: {row['error']}", flush=True)
                    continue
                print(f"{name:<20}{target:<14}{shown:<9}{run:<6}{row['first_step_s']:>13.2f}{row['step_s']:>8.3f}"
                      f"{row['compile_overhead_s']:>11.2f}{row['wall_s']:>8.1f}{row['cache_state'] or '-':>9}"
                      f"{row['hits'] if row['hits'] is not None else '-':>6}"
                      f"{row['misses'] if row['misses'] is not None else '-':>7}"
                      f"{row['cache_bytes'] / 2 ** 20:>10.1f}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    machine = describe()
    (out / "compile.json").write_text(json.dumps({"machine": machine, "rows": rows}, indent=2))
    print(f"wrote {out / 'compile.json'}")


if __name__ == "__main__":
    main()
