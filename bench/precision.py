"""What each precision costs: ``xbridge compare`` of one program in fp32, bf16-mixed and bf16-true on every target
here, one precision after the other (one target at a time inside each compare, so nothing shares the cores).

Per target and precision: median step time, its ratio to the same target's fp32 step (a ratio within one run: the
machine is shared and noisy), peak host RSS (CPU) or device memory (accelerators), and the final loss. Whether
bfloat16 is faster depends on the compiler's CPU kernels as much as on the chip: docs/results.md has the figures.
Prints a table, writes precision.json.

    .venv/bin/python bench/precision.py [--program programs/gpt.py] [--steps 20]
                                        [--backends eager-cpu,inductor-cpu,jax-cpu,xla-cpu]
                                        [--out bench/results/precision]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from compare_runs import compare, row_figures

HERE = Path(__file__).resolve().parent
PRECISIONS = ("fp32", "bf16-mixed", "bf16-true")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--program", default="programs/gpt.py")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--backends", default="eager-cpu,inductor-cpu,jax-cpu,xla-cpu")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "precision")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for precision in PRECISIONS:
        record = compare(args.program, args.steps, args.backends, args.out / precision, "--precision", precision)
        rows += [{**row_figures(row), "precision": precision} for row in record["targets"]]
    fp32 = {r["target"]: r["step_ms"] for r in rows if r["precision"] == "fp32" and r["step_ms"]}
    for r in rows:
        base = fp32.get(r["target"])
        r["step_vs_fp32"] = r["step_ms"] / base if base and r["step_ms"] else None
    print(f"{'target':14} {'precision':11} {'step ms':>9} {'vs fp32':>8} {'memory MiB':>11} {'final loss':>11}")
    for r in rows:
        if r["step_ms"] is None:
            print(f"{r['target']:14} {r['precision']:11} error: {r['error']}")
            continue
        print(f"{r['target']:14} {r['precision']:11} {r['step_ms']:9.1f} {r['step_vs_fp32']:8.2f} "
              f"{r['memory_mib']:11.0f} {r['final_loss']:11.4f}")
    (args.out / "precision.json").write_text(json.dumps({"program": args.program, "steps": args.steps,
                                                         "machine": record.get("machine"), "rows": rows}, indent=2))
    print(f"wrote {args.out / 'precision.json'}")


if __name__ == "__main__":
    main()
