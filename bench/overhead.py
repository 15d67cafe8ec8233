"""xbridge's step against a hand-written native loop of the same model, batch and precision, per backend.

    .venv/bin/python bench/overhead.py [--program programs/gpt.py] [--backends eager,inductor,jax,xla] [--rounds 7]
                                       [--steps-per-round 5] [--out bench/results/overhead]

Each backend runs in its own process (runtimes are per process). Inside it, both loops are built from the same
initial weights, warmed up (compiled), then timed in alternating rounds of K steps each (xbridge, native, xbridge,
native, ...), so machine noise hits both alike; the ratio of each round pair is xbridge / native and the table
reports the median ratio with its spread. Target: <= 1.02. Prints a table, writes overhead.json and overhead.png.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent


def child(program_path: str, backend: str, rounds: int, per_round: int, precision: str | None) -> dict:
    sys.path.insert(0, str(HERE))
    from native_loops import NATIVE, TARGET

    from xbridge.program_file import load_program
    from xbridge.run.loop import RunOptions, prepare
    from xbridge.weights import initial_weights

    program = load_program(program_path)
    if precision:
        program = program.replace(precision=precision)
    weights = initial_weights(program)
    prepared = prepare(program, TARGET[backend], RunOptions(steps=2, warmup=1), weights)
    ours = prepared.executable.step
    native = NATIVE[backend](program, weights)
    batches = [program.data.batch(i, program.seed) for i in range(per_round)]
    for batch in batches[:2]:      # warm-up: compilation happens here for both
        ours(batch)
        native(batch)
    pairs = []
    for _ in range(rounds):
        times = []
        for fn in (lambda b: ours(b)["loss"], native):
            start = time.perf_counter()
            for batch in batches:
                fn(batch)
            times.append((time.perf_counter() - start) / per_round)
        pairs.append(times)
    pairs_arr = np.array(pairs)
    ratios = pairs_arr[:, 0] / pairs_arr[:, 1]
    return {"backend": backend, "target": TARGET[backend], "program": program.name,
            "precision": program.precision.name, "rounds": rounds, "steps_per_round": per_round,
            "xbridge_step_ms_median": float(np.median(pairs_arr[:, 0]) * 1e3),
            "native_step_ms_median": float(np.median(pairs_arr[:, 1]) * 1e3),
            "ratio_median": float(np.median(ratios)), "ratio_p10": float(np.percentile(ratios, 10)),
            "ratio_p90": float(np.percentile(ratios, 90)), "ratios": ratios.tolist()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--program", default=str(HERE.parent / "programs" / "gpt.py"))
    parser.add_argument("--backends", default="eager,inductor,jax,xla")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps-per-round", type=int, default=5)
    parser.add_argument("--precision", default=None)
    parser.add_argument("--out", default=str(HERE / "results" / "overhead"))
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.program, args.child, args.rounds, args.steps_per_round, args.precision)))
        return

    rows = []
    for backend in [b.strip() for b in args.backends.split(",") if b.strip()]:
        cmd = [sys.executable, __file__, "--child", backend, "--program", args.program, "--rounds", str(args.rounds),
               "--steps-per-round", str(args.steps_per_round)]
        cmd += ["--precision", args.precision] if args.precision else []
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PJRT_DEVICE": "CPU"})
        if proc.returncode != 0:
            rows.append({"backend": backend, "error": proc.stderr.strip().splitlines()[-1:]})
            print(f"{backend}: failed: {proc.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
            continue
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))

    print(f"{'backend':8s} {'xbridge ms':>11s} {'native ms':>10s} {'ratio (median)':>15s} {'p10-p90':>14s}")
    for r in rows:
        if "error" in r:
            print(f"{r['backend']:8s} failed: {r['error']}")
            continue
        print(f"{r['backend']:8s} {r['xbridge_step_ms_median']:11.2f} {r['native_step_ms_median']:10.2f} "
              f"{r['ratio_median']:15.3f} {r['ratio_p10']:6.3f}-{r['ratio_p90']:.3f}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {"program": args.program, "rows": rows, "machine": {"cpu_count": os.cpu_count()}}
    (out / "overhead.json").write_text(json.dumps(record, indent=2))
    ok = [r for r in rows if "error" not in r]
    if ok:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        ax.bar([r["backend"] for r in ok], [r["ratio_median"] for r in ok],
               yerr=[[r["ratio_median"] - r["ratio_p10"] for r in ok],
                     [r["ratio_p90"] - r["ratio_median"] for r in ok]],
               capsize=6, color="tab:purple", alpha=0.8)
        ax.axhline(1.02, color="red", linestyle="--", label="target 1.02")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set(ylabel="xbridge step / native step (median)", title=f"overhead: {Path(args.program).name}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "overhead.png", dpi=110)
    print(f"wrote {out / 'overhead.json'}")


if __name__ == "__main__":
    main()
