"""What portable randomness costs: ``xbridge compare`` of a program with dropout under ``--rng native`` (each
stack's own generator) and ``--rng portable`` (Threefry-2x32 computed in the step), on every target here, one after
the other (one target at a time inside each compare).

Per target: median step time under each, the ratio portable / native (a ratio within one run: the machine is shared
and noisy), memory and final loss. Prints a table, writes rng.json.

    .venv/bin/python bench/rng.py [--program programs/gpt.py:gpt_dropout] [--steps 12]
                                  [--backends eager-cpu,inductor-cpu,jax-cpu,xla-cpu] [--out bench/results/rng]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from compare_runs import compare, row_figures

HERE = Path(__file__).resolve().parent
MODES = ("native", "portable")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--program", default="programs/gpt.py:gpt_dropout")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--backends", default="eager-cpu,inductor-cpu,jax-cpu,xla-cpu")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "rng")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for mode in MODES:
        record = compare(args.program, args.steps, args.backends, args.out / mode, "--rng", mode)
        rows += [{**row_figures(row), "rng": mode} for row in record["targets"]]
    native = {r["target"]: r["step_ms"] for r in rows if r["rng"] == "native" and r["step_ms"]}
    for r in rows:
        base = native.get(r["target"])
        r["step_vs_native"] = r["step_ms"] / base if base and r["step_ms"] else None
    print(f"{'target':14} {'rng':9} {'step ms':>9} {'vs native':>10} {'memory MiB':>11} {'final loss':>11}")
    for r in rows:
        if r["step_ms"] is None:
            print(f"{r['target']:14} {r['rng']:9} error: {r['error']}")
            continue
        print(f"{r['target']:14} {r['rng']:9} {r['step_ms']:9.1f} {r['step_vs_native']:10.2f} "
              f"{r['memory_mib']:11.0f} {r['final_loss']:11.4f}")
    (args.out / "rng.json").write_text(json.dumps({"program": args.program, "steps": args.steps,
                                                   "machine": record.get("machine"), "rows": rows}, indent=2))
    print(f"wrote {args.out / 'rng.json'}")


if __name__ == "__main__":
    main()
