"""What activation checkpointing saves and costs: ``xbridge compare`` of one program with ``--remat none``, ``full``
and ``dots`` on every target here, one setting after the other (one target at a time inside each compare).

Per target and setting: median step time and its ratio to the same target's ``none`` (a ratio within one run: the
machine is shared and noisy), peak memory (device memory on accelerators, peak host RSS on CPU, where it includes
the runtime and the compiler's own peak), and the final loss (the same with and without remat: recomputation
changes no result). Prints a table, writes remat.json.

    .venv/bin/python bench/remat.py [--program programs/gpt.py:gpt_seq1024] [--steps 5]
                                    [--backends eager-cpu,inductor-cpu,jax-cpu,xla-cpu] [--out bench/results/remat]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from compare_runs import race

HERE = Path(__file__).resolve().parent
SETTINGS = ("none", "full", "dots")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--program", default="programs/gpt.py:gpt_seq1024")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--backends", default="eager-cpu,inductor-cpu,jax-cpu,xla-cpu")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "remat")
    args = parser.parse_args()
    race(args.program, args.steps, args.backends, args.out, "remat", SETTINGS)


if __name__ == "__main__":
    main()
