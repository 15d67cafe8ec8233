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
from pathlib import Path

from compare_runs import race

HERE = Path(__file__).resolve().parent
MODES = ("native", "portable")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--program", default="programs/gpt.py:gpt_dropout")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--backends", default="eager-cpu,inductor-cpu,jax-cpu,xla-cpu")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "rng")
    args = parser.parse_args()
    race(args.program, args.steps, args.backends, args.out, "rng", MODES)


if __name__ == "__main__":
    main()
