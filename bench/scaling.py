"""Sweep the GPT's width and depth: step time, compile time and MFU per backend.

    .venv/bin/python bench/scaling.py [--dims 128,256] [--layers 2,4] [--backends eager-cpu,jax-cpu,xla-cpu]
                                      [--steps 6] [--out bench/results/scaling]

Each (configuration, target) is one `xbridge run` process, through the same machinery as `xbridge compare`
(xbridge/compare.py), so the numbers mean the same thing. Prints a table, writes scaling.json and scaling.png.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dims", default="128,256")
    parser.add_argument("--layers", default="2,4")
    parser.add_argument("--backends", default="eager-cpu,jax-cpu,xla-cpu")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", default=str(HERE / "results" / "scaling"))
    args = parser.parse_args()

    from xbridge.compare.job import CompareOptions, metrics_of
    from xbridge.program_file import load_program
    from xbridge.run.isolated import run_target
    from xbridge.torch.flops import flops_per_step

    out = Path(args.out)
    targets = [t.strip() for t in args.backends.split(",") if t.strip()]
    options = CompareOptions(targets=targets, steps=args.steps, warmup=2)
    rows = []
    for dim in [int(d) for d in args.dims.split(",")]:
        for layers in [int(n) for n in args.layers.split(",")]:
            os.environ["XB_SCALING_DIM"], os.environ["XB_SCALING_LAYERS"] = str(dim), str(layers)
            program = load_program(str(HERE / "scaling_gpt.py"))
            runs = [run_target(str(HERE / "scaling_gpt.py"), t, options.child(), out / "runs" / f"d{dim}-l{layers}")
                    for t in targets]
            flops = flops_per_step(program)
            metrics = metrics_of(program, runs, flops)
            for run in runs:
                row = {"dim": dim, "layers": layers, "target": run.target, "status": run.status,
                       "gflop_per_step": flops / 1e9}
                m = metrics.get(run.target)
                if m is not None:
                    row |= {"compile_s": m.compile_s, "step_ms": m.step_ms_median, "mfu": m.mfu,
                            "loss_parity": m.loss_parity}
                else:
                    row["error"] = (run.error or "").splitlines()[0]
                rows.append(row)
                print(f"d={dim:4d} L={layers:2d} {run.target:10s} {row['gflop_per_step']:7.2f} GFLOP "
                      + (f"compile {row['compile_s']:6.2f} s  step {row['step_ms']:8.1f} ms  MFU "
                         f"{100 * row['mfu']:5.1f}%"
                         if m is not None else row["error"]), flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "scaling.json").write_text(json.dumps({"rows": rows, "steps": args.steps}, indent=2))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for target in targets:
        ok = [r for r in rows if r["target"] == target and r["status"] == "ok"]
        x = [r["gflop_per_step"] for r in ok]
        axes[0].plot(x, [r["step_ms"] for r in ok], "o-", label=target)
        axes[1].plot(x, [100 * r["mfu"] for r in ok], "o-", label=target)
    axes[0].set(xlabel="model GFLOP per step", ylabel="step time, ms (median)", title="step time vs model size")
    axes[1].set(xlabel="model GFLOP per step", ylabel="MFU, %", title="MFU vs model size")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "scaling.png", dpi=110)
    print(f"wrote {out / 'scaling.json'}")


if __name__ == "__main__":
    main()
