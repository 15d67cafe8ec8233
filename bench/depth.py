"""Compile time against depth: the GPT at 2, 8 and 24 layers (bench/depth_programs.py), unrolled and with its layers
scanned, each a fresh ``xbridge run`` process on an empty cache folder (a cold compile).

Per target, depth and form: the first step (tracing + compilation + one step: ``summary.compile_s``), the compile
itself where the stack measures it (jax: trace + lower + XLA compile, the run record's ``compile_cache.seconds``),
the median step after warm-up, and three ratios measured in this one run (the machine is shared and noisy): the
first step and the compile against the same form at 2 layers, and the scanned step time against the unrolled one.
Prints a table, writes depth.json.

    .venv/bin/python bench/depth.py [--backends jax-cpu] [--depths 2,8,24] [--steps 5] [--out bench/results/depth]
"""

from __future__ import annotations

import argparse
import json
import os
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backends", default="jax-cpu")
    parser.add_argument("--depths", default="2,8,24")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "depth")
    args = parser.parse_args()
    depths = [int(d) for d in args.depths.split(",")]
    rows = []
    for target in args.backends.split(","):
        for depth in depths:
            for form in ("unrolled", "scan"):
                name = f"gpt_{depth}" + ("_scan" if form == "scan" else "")
                rows.append({"target": target, "layers": depth, "form": form,
                             **run_one(f"{HERE / 'depth_programs.py'}:{name}", target, args.steps)})
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
    path.write_text(json.dumps({"rows": rows, "steps": args.steps}, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
