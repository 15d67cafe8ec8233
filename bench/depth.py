"""Compile time against depth: the GPT at 2, 8 and 24 layers (bench/depth_programs.py), unrolled and with its layers
scanned, each a fresh ``xbridge run`` process on an empty cache folder (a cold compile).

Per target, depth and form: the first step (tracing + compilation + one step: ``summary.compile_s``), the compile
itself where the stack measures it (jax: trace + lower + XLA compile, the run record's ``compile_cache.seconds``),
the median step after warm-up, and three ratios measured in this one run (the machine is shared and noisy): the
first step and the compile against the same form at 2 layers, and the scanned step time against the unrolled one.
With ``--repeat R`` each depth runs unrolled and scanned alternately R times and every figure is the median of the R
runs (the per-run step medians are kept in the JSON): a shallow step of a few hundred ms moves by several percent
between processes on a shared machine. Prints a table, writes depth.json.

    .venv/bin/python bench/depth.py [--backends jax-cpu] [--depths 2,8,24] [--steps 5] [--repeat 1]
                                    [--out bench/results/depth]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def run_one(program: str, target: str, steps: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="xbridge-depth-") as cache:
        env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "JAX_COMPILATION_CACHE_DIR")}
        env["XBRIDGE_CACHE_DIR"] = cache
        cmd = [sys.executable, "-m", "xbridge", "run", program, "--backend", target, "--steps", str(steps),
               "--warmup", "2", "--format", "json"]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]}
    record = json.loads(proc.stdout)
    summary = record["summary"]
    # the compile itself, where the stack measures it (jax: tracing, lowering and XLA's compile, from JAX's own
    # monitoring events, every compile of the run)
    seconds = (record.get("compile_cache") or {}).get("seconds") or {}
    return {"first_step_s": summary["compile_s"], "step_s": summary["step_time_median_s"],
            "compile_s": sum(seconds.values()) if seconds else None, "final_loss": summary["final_loss"]}


def median_of(results: list[dict]) -> dict:
    """One run's figures, or the median of each over several runs (the first error if any run failed)."""
    failed = [r for r in results if "error" in r]
    if failed:
        return failed[0]
    if len(results) == 1:
        return results[0]
    out = {key: (statistics.median(r[key] for r in results) if results[0][key] is not None else None)
           for key in ("first_step_s", "step_s", "compile_s")}
    return {**out, "final_loss": results[0]["final_loss"], "step_s_runs": [r["step_s"] for r in results]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backends", default="jax-cpu")
    parser.add_argument("--depths", default="2,8,24")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "depth")
    args = parser.parse_args()
    depths = [int(d) for d in args.depths.split(",")]
    rows = []
    for target in args.backends.split(","):
        for depth in depths:
            runs: dict[str, list[dict]] = {"unrolled": [], "scan": []}
            for _ in range(args.repeat):        # alternately, so that both forms see the same machine
                for form in runs:
                    name = f"gpt_{depth}" + ("_scan" if form == "scan" else "")
                    runs[form].append(run_one(f"{HERE / 'depth_programs.py'}:{name}", target, args.steps))
            for form, results in runs.items():
                rows.append({"target": target, "layers": depth, "form": form, **median_of(results)})
    base = {(r["target"], r["form"]): r for r in rows if r["layers"] == depths[0] and "error" not in r}
    unrolled = {(r["target"], r["layers"]): r["step_s"] for r in rows if r["form"] == "unrolled" and "error" not in r}
    vs = f"vs {depths[0]} layers"
    print(f"{'target':10} {'layers':>6} {'form':9} {'first step s':>12} {vs:>12} {'compile s':>9} {vs:>12} "
          f"{'step ms':>9} {'vs unrolled':>11} {'final loss':>10}")
    for r in rows:
        if "error" in r:
            print(f"{r['target']:10} {r['layers']:6} {r['form']:9} error: {r['error']}")
            continue
        shallowest = base[(r["target"], r["form"])]
        r["first_step_vs_shallowest"] = r["first_step_s"] / shallowest["first_step_s"]
        r["compile_vs_shallowest"] = (r["compile_s"] / shallowest["compile_s"]
                                      if r["compile_s"] and shallowest["compile_s"] else None)
        r["step_vs_unrolled"] = r["step_s"] / unrolled[(r["target"], r["layers"])]
        compile_s = (f"{r['compile_s']:9.2f} {r['compile_vs_shallowest']:12.2f}" if r["compile_vs_shallowest"]
                     else f"{'-':>9} {'-':>12}")
        print(f"{r['target']:10} {r['layers']:6} {r['form']:9} {r['first_step_s']:12.2f} "
              f"{r['first_step_vs_shallowest']:12.2f} {compile_s} {1e3 * r['step_s']:9.1f} "
              f"{r['step_vs_unrolled']:11.2f} {r['final_loss']:10.4f}")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "depth.json"
    path.write_text(json.dumps({"rows": rows, "steps": args.steps, "repeat": args.repeat}, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
