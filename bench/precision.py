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
from pathlib import Path

from compare_runs import race

HERE = Path(__file__).resolve().parent
PRECISIONS = ("fp32", "bf16-mixed", "bf16-true")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--program", default="programs/gpt.py")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--backends", default="eager-cpu,inductor-cpu,jax-cpu,xla-cpu")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "precision")
    args = parser.parse_args()
    race(args.program, args.steps, args.backends, args.out, "precision", PRECISIONS)


if __name__ == "__main__":
    main()
