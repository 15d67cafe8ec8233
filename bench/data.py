"""Prefetch: does producing the batch cost step time? Per backend, the same program and executable fed three ways:

- ``memory``: every batch computed beforehand, handed over from memory (the loop's prefetch on);
- ``slow``: a source whose ``batch()`` takes a fixed time on top of reading the same batch: ``--fraction`` (default
  0.4) of the median memory-fed step, measured first. Run twice: with the loop's prefetch and without it.

The producer's time is spent either waiting (``--producer io``: a sleep, as for storage or network reads; the GIL is
released) or computing (``--producer cpu``: numpy work, competing with the step for the machine's cores).

The step time is the loop's (``StepRecord.time_s``: waiting for the batch + the step). Rounds alternate the feeds; the
figure is the median over rounds of (prefetched slow step / memory step), with a bootstrap 95% interval. Target: the
I/O-bound producer prefetched within 1.05 of memory. Each backend runs in its own process. Prints a table, writes
data.json.

    .venv/bin/python bench/data.py [--backends eager,inductor,jax,xla] [--producer io,cpu] [--rounds 6]
                                   [--steps-per-round 4] [--fraction 0.4] [--out bench/results/data]
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
TARGET = {"eager": "eager-cpu", "inductor": "inductor-cpu", "jax": "jax-cpu", "xla": "xla-cpu"}


class Slow:
    """The program's own source, made slow: each batch costs ``delay`` seconds more to produce."""

    def __init__(self, source, delay: float, producer: str) -> None:
        self.source, self.delay, self.producer = source, delay, producer
        self.batch_size = source.batch_size

    def batch(self, step: int, seed: int) -> dict:
        start = time.perf_counter()
        batch = self.source.batch(step, seed)
        if self.producer == "io":
            time.sleep(max(0.0, self.delay - (time.perf_counter() - start)))
        else:
            work = np.random.default_rng(step).standard_normal(200_000)
            while time.perf_counter() - start < self.delay:
                np.sort(work)
        return batch


class Memory:
    """Batches computed beforehand (by step)."""

    def __init__(self, source, seed: int, steps: range) -> None:
        self.batch_size = source.batch_size
        self.batches = {s: source.batch(s, seed) for s in steps}

    def batch(self, step: int, seed: int) -> dict:
        return self.batches[step]


def child(program_path: str, backend: str, producer: str, rounds: int, per_round: int, fraction: float) -> dict:
    sys.path.insert(0, str(HERE))
    from overhead import median_interval

    from xbridge.program_file import load_program
    from xbridge.run.loop import RunOptions
    from xbridge.run.prepare import prepare
    from xbridge.run.steps import train

    program = load_program(program_path)
    prepared = prepare(program, TARGET[backend], RunOptions(steps=2, warmup=1))
    step = 0

    def timed(source, prefetch: bool) -> list[float]:
        nonlocal step
        records = train(program.replace(data=source), prepared, step + per_round, warmup=per_round, start=step,
                        prefetch=prefetch)
        step += per_round
        return [r.time_s for r in records]

    total = 2 * per_round + rounds * 3 * per_round
    memory = Memory(program.data, program.seed, range(total + per_round))
    timed(memory, True)                     # compile and warm up
    base = float(np.median(timed(memory, True)))
    slow = Slow(memory, fraction * base, producer)
    produce = []
    for s in range(3):                      # what one slow batch costs, alone
        start = time.perf_counter()
        slow.batch(s, program.seed)
        produce.append(time.perf_counter() - start)
    times: dict[str, list[float]] = {"memory": [], "prefetch": [], "serial": []}
    for r in range(rounds):
        order = ["memory", "prefetch", "serial"] if r % 2 == 0 else ["serial", "prefetch", "memory"]
        for name in order:
            source = memory if name == "memory" else slow
            times[name].append(float(np.median(timed(source, name != "serial"))))
    ratio = np.array(times["prefetch"]) / np.array(times["memory"])
    serial = np.array(times["serial"]) / np.array(times["memory"])
    low, high = median_interval(ratio)
    return {"backend": backend, "target": TARGET[backend], "program": program.name, "producer": producer,
            "rounds": rounds, "steps_per_round": per_round,
            "memory_step_ms": float(np.median(times["memory"]) * 1e3),
            "produce_ms": float(np.median(produce) * 1e3),
            "produce_fraction": float(np.median(produce) / np.median(times["memory"])),
            "prefetch_step_ms": float(np.median(times["prefetch"]) * 1e3),
            "serial_step_ms": float(np.median(times["serial"]) * 1e3),
            "prefetch_ratio": float(np.median(ratio)), "prefetch_ratio_ci95": [low, high],
            "serial_ratio": float(np.median(serial)), "within_5pct": bool(np.median(ratio) <= 1.05)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--program", default=str(HERE.parent / "programs" / "gpt.py"))
    parser.add_argument("--backends", default="eager,inductor,jax,xla")
    parser.add_argument("--producer", default="io,cpu")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps-per-round", type=int, default=4)
    parser.add_argument("--fraction", type=float, default=0.4)
    parser.add_argument("--out", default=str(HERE / "results" / "data"))
    parser.add_argument("--child", nargs=2, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.program, args.child[0], args.child[1], args.rounds, args.steps_per_round,
                               args.fraction)))
        return
    rows = []
    for producer in [p.strip() for p in args.producer.split(",") if p.strip()]:
        for backend in [b.strip() for b in args.backends.split(",") if b.strip()]:
            cmd = [sys.executable, __file__, "--child", backend, producer, "--program", args.program, "--rounds",
                   str(args.rounds), "--steps-per-round", str(args.steps_per_round), "--fraction", str(args.fraction)]
            proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PJRT_DEVICE": "CPU"})
            if proc.returncode != 0:
                rows.append({"backend": backend, "producer": producer, "error": proc.stderr.strip().splitlines()[-1:]})
                print(f"{backend} ({producer}): failed: {rows[-1]['error']}", file=sys.stderr)
                continue
            rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(f"done {backend} ({producer})", file=sys.stderr)
    print(f"{'backend':9s} {'producer':8s} {'memory ms':>10s} {'produce ms':>11s} {'(x step)':>8s} "
          f"{'prefetch ms':>12s} {'ratio':>6s} {'95% CI':>13s} {'serial ms':>10s} {'ratio':>6s}")
    for r in rows:
        if "error" in r:
            print(f"{r['backend']:9s} {r['producer']:8s} failed: {r['error']}")
            continue
        low, high = r["prefetch_ratio_ci95"]
        print(f"{r['backend']:9s} {r['producer']:8s} {r['memory_step_ms']:10.1f} {r['produce_ms']:11.1f} "
              f"{r['produce_fraction']:8.2f} {r['prefetch_step_ms']:12.1f} {r['prefetch_ratio']:6.3f} "
              f"{low:6.3f}-{high:.3f} {r['serial_step_ms']:10.1f} {r['serial_ratio']:6.3f}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "data.json").write_text(json.dumps({"program": args.program, "rows": rows,
                                               "machine": {"cpu_count": os.cpu_count()}}, indent=2))
    print(f"wrote {out / 'data.json'}")


if __name__ == "__main__":
    main()
