"""What a checkpoint costs: size, save time and load time against one training step, per backend.

    .venv/bin/python bench/checkpoint_io.py [--program programs/gpt.py] [--backends eager,jax] [--rounds 5]
                                            [--out bench/results/checkpoint]

Each backend runs in its own process. It takes two steps (so the optimizer state exists), then alternates rounds
of one step and one save (state pulled from the device, both files written and fsynced, renamed) and one verified
load (checksums, tensors against the program); the table reports medians and save and load time as a ratio of the
step time measured in the same rounds. Prints a table, writes checkpoint.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
TARGET = {"eager": "eager-cpu", "inductor": "inductor-cpu", "jax": "jax-cpu", "xla": "xla-cpu"}


def child(program_path: str, backend: str, rounds: int) -> dict:
    from xbridge.program_file import load_program
    from xbridge.run import checkpoint
    from xbridge.run.loop import RunOptions, prepare

    program = load_program(program_path)
    prepared = prepare(program, TARGET[backend], RunOptions(steps=2, warmup=1))
    executable = prepared.executable
    for step in range(2):
        executable.step(program.data.batch(step, program.seed))
    directory = Path(tempfile.mkdtemp(prefix="xbridge-ckpt-bench-"))
    writer = checkpoint.Writer(directory, keep=2, start_step=0)
    step_s, save_s, load_s, size = [], [], [], 0
    try:
        for i in range(rounds):
            batch = program.data.batch(2 + i, program.seed)
            start = time.perf_counter()
            executable.step(batch)
            step_s.append(time.perf_counter() - start)
            start = time.perf_counter()
            info = checkpoint.manifest_info(program, TARGET[backend], 1, dict(prepared.plan.mesh), 3 + i, {})
            path = writer.save(3 + i, executable.state_dict(), executable.training_state(), info)
            save_s.append(time.perf_counter() - start)
            size = sum(p.stat().st_size for p in path.iterdir())
            start = time.perf_counter()
            checkpoint.load(path, program)
            load_s.append(time.perf_counter() - start)
    finally:
        shutil.rmtree(directory)
    med = {k: float(np.median(v)) for k, v in (("step_s", step_s), ("save_s", save_s), ("load_s", load_s))}
    return {"backend": backend, "bytes": size, **med, "save_over_step": med["save_s"] / med["step_s"],
            "load_over_step": med["load_s"] / med["step_s"], "rounds": rounds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--program", default="programs/gpt.py")
    parser.add_argument("--backends", default="eager,jax")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default="bench/results/checkpoint")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.program, args.child, args.rounds)))
        return
    rows = []
    for backend in args.backends.split(","):
        proc = subprocess.run([sys.executable, __file__, "--program", args.program, "--rounds", str(args.rounds),
                               "--child", backend], capture_output=True, text=True)
        if proc.returncode != 0:
            print(f"{backend}: failed\n{proc.stderr[-2000:]}", file=sys.stderr)
            continue
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    print(f"{'backend':<10}{'size MiB':>10}{'step ms':>10}{'save ms':>10}{'load ms':>10}{'save/step':>11}"
          f"{'load/step':>11}")
    for r in rows:
        print(f"{r['backend']:<10}{r['bytes'] / 2**20:>10.1f}{r['step_s'] * 1e3:>10.1f}{r['save_s'] * 1e3:>10.1f}"
              f"{r['load_s'] * 1e3:>10.1f}{r['save_over_step']:>11.2f}{r['load_over_step']:>11.2f}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "checkpoint.json").write_text(json.dumps({"program": args.program, "rows": rows}, indent=2))
    print(f"wrote {out / 'checkpoint.json'}")


if __name__ == "__main__":
    main()
