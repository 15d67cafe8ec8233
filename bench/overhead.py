"""xbridge's step against a hand-written native loop of the same model, batch and precision, per backend.

    .venv/bin/python bench/overhead.py [--program programs/gpt.py] [--backends eager,inductor,jax,xla]
                                       [--min-rounds 10] [--max-rounds 60] [--budget-s 240] [--steps-per-round 3]
                                       [--out bench/results/overhead]

Each backend runs in its own process (runtimes are per process). Inside it, both loops are built from the same
initial weights, warmed up (compiled), then timed in rounds of K steps each; which loop goes first alternates from
round to round, so neither always runs on a cooler or a warmer machine. The ratio of each round pair is
xbridge / native. Rounds continue until the 95% confidence interval of the median ratio (bootstrap over the
rounds) is narrower than 0.02, the 2% the overhead target is judged against, or until --max-rounds or --budget-s.
Both loops train on the same batches from the same weights, so their losses must agree step by step within the
parity policy (docs/parity.md); a run where they do not is reported as an error, not as a ratio.
Target: median <= 1.02 with the interval resolved. Prints a table, writes overhead.json and overhead.png.
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
sys.path.insert(0, str(HERE))
from machine import cpu, describe  # noqa: E402


def median_interval(ratios: np.ndarray, draws: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% bootstrap confidence interval of the median."""
    rng = np.random.default_rng(seed)
    medians = np.median(rng.choice(ratios, size=(draws, ratios.size), replace=True), axis=1)
    return float(np.percentile(medians, 2.5)), float(np.percentile(medians, 97.5))


def child(program_path: str, backend: str, limits: dict, per_round: int, precision: str | None) -> dict:
    sys.path.insert(0, str(HERE))
    from native_loops import NATIVE, TARGET

    from xbridge.parity import policy
    from xbridge.program_file import load_program
    from xbridge.run.loop import RunOptions
    from xbridge.run.prepare import prepare
    from xbridge.torch.weights import initial_weights

    program = load_program(program_path)
    if precision:
        program = program.replace(precision=precision)
    weights = initial_weights(program)
    prepared = prepare(program, TARGET[backend], RunOptions(steps=2, warmup=1), weights)
    ours = prepared.executable.step
    native = NATIVE[backend](program, weights)
    batches = [program.data.batch(i, program.seed) for i in range(per_round)]
    losses: dict[str, list[float]] = {"xbridge": [], "native": []}
    loops = {"xbridge": lambda b: float(ours(b)["loss"]), "native": lambda b: float(native(b))}
    for batch in batches[:2]:      # warm-up: compilation happens here for both
        for name, fn in loops.items():
            losses[name].append(fn(batch))
    pairs: list[dict[str, float]] = []
    start_all = time.perf_counter()
    interval = (0.0, float("inf"))
    while len(pairs) < limits["max_rounds"]:
        order = ["xbridge", "native"] if len(pairs) % 2 == 0 else ["native", "xbridge"]
        times = {}
        for name in order:
            start = time.perf_counter()
            for batch in batches:
                losses[name].append(loops[name](batch))
            times[name] = (time.perf_counter() - start) / per_round
        pairs.append(times)
        ratios = np.array([p["xbridge"] / p["native"] for p in pairs])
        if len(pairs) >= limits["min_rounds"]:
            interval = median_interval(ratios)
            if interval[1] - interval[0] < 0.02 or time.perf_counter() - start_all > limits["budget_s"]:
                break
    tol = policy.tolerance(program.precision)
    agreement = policy.loss_deviation(losses["native"], losses["xbridge"], tol)
    xb_times = np.array([p["xbridge"] for p in pairs])
    native_times = np.array([p["native"] for p in pairs])
    return {"backend": backend, "target": TARGET[backend], "program": program.name,
            "precision": program.precision.name, "rounds": len(pairs), "steps_per_round": per_round,
            "xbridge_step_ms_median": float(np.median(xb_times) * 1e3),
            "native_step_ms_median": float(np.median(native_times) * 1e3),
            "ratio_median": float(np.median(ratios)), "ratio_ci95": list(interval),
            "resolved": interval[1] - interval[0] < 0.02, "ratio_p10": float(np.percentile(ratios, 10)),
            "ratio_p90": float(np.percentile(ratios, 90)), "ratios": ratios.tolist(),
            "losses_agree": agreement.ok, "max_loss_dev": agreement.value, "max_loss_dev_at": agreement.where,
            "steps_per_loop": len(losses["xbridge"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--program", default=str(HERE.parent / "programs" / "gpt.py"))
    parser.add_argument("--backends", default="eager,inductor,jax,xla")
    parser.add_argument("--min-rounds", type=int, default=10)
    parser.add_argument("--max-rounds", type=int, default=60)
    parser.add_argument("--budget-s", type=float, default=240.0, help="per backend, for the timed rounds")
    parser.add_argument("--steps-per-round", type=int, default=3)
    parser.add_argument("--precision", default=None)
    parser.add_argument("--out", default=str(HERE / "results" / "overhead"))
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        limits = {"min_rounds": args.min_rounds, "max_rounds": args.max_rounds, "budget_s": args.budget_s}
        print(json.dumps(child(args.program, args.child, limits, args.steps_per_round, args.precision)))
        return

    rows = []
    for backend in [b.strip() for b in args.backends.split(",") if b.strip()]:
        cmd = [sys.executable, __file__, "--child", backend, "--program", args.program, "--min-rounds",
               str(args.min_rounds), "--max-rounds", str(args.max_rounds), "--budget-s", str(args.budget_s),
               "--steps-per-round", str(args.steps_per_round)]
        cmd += ["--precision", args.precision] if args.precision else []
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PJRT_DEVICE": "CPU"})
        if proc.returncode != 0:
            rows.append({"backend": backend, "error": proc.stderr.strip().splitlines()[-1:]})
            print(f"{backend}: failed: {proc.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
            continue
        row = json.loads(proc.stdout.strip().splitlines()[-1])
        if not row["losses_agree"]:      # two different computations: their speed ratio means nothing
            row = {"backend": backend, "error": [f"losses disagree: {row['max_loss_dev']:.2e} at "
                                                 f"{row['max_loss_dev_at']}"], "measured": row}
        rows.append(row)

    print(f"on {cpu()}, {os.cpu_count()} cores")
    print(f"{'backend':8s} {'xbridge ms':>11s} {'native ms':>10s} {'ratio (median)':>15s} {'95% CI':>14s} "
          f"{'rounds':>7s} {'resolved':>9s} {'loss dev':>9s}")
    for r in rows:
        if "error" in r:
            print(f"{r['backend']:8s} failed: {r['error']}")
            continue
        low, high = r["ratio_ci95"]
        print(f"{r['backend']:8s} {r['xbridge_step_ms_median']:11.2f} {r['native_step_ms_median']:10.2f} "
              f"{r['ratio_median']:15.3f} {low:6.3f}-{high:.3f} {r['rounds']:7d} {str(r['resolved']):>9s} "
              f"{r['max_loss_dev']:9.1e}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {"program": args.program, "rows": rows, "machine": describe()}
    (out / "overhead.json").write_text(json.dumps(record, indent=2))
    ok = [r for r in rows if "error" not in r]
    if ok:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        ax.bar([r["backend"] for r in ok], [r["ratio_median"] for r in ok],
               yerr=[[r["ratio_median"] - r["ratio_ci95"][0] for r in ok],
                     [r["ratio_ci95"][1] - r["ratio_median"] for r in ok]],
               capsize=6, color="tab:purple", alpha=0.8)
        ax.axhline(1.02, color="red", linestyle="--", label="target 1.02")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set(ylabel="xbridge step / native step (median, 95% CI)", title=f"overhead: {Path(args.program).name}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "overhead.png", dpi=110)
    print(f"wrote {out / 'overhead.json'}")


if __name__ == "__main__":
    main()
