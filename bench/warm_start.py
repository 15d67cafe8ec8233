"""An ``xbridge run`` started fresh against the same command forked from a warm server (xbridge/processes/warm.py).

    .venv/bin/python bench/warm_start.py [--program tests/fixtures/hf_zoo.py:resnet] [--steps 6]
                                         [--backends eager-cpu,inductor-cpu,jax-cpu,xla-cpu] [--rounds 3]
                                         [--out bench/results/warm-start]

Starts one warm server per interpreter the targets run in (this one, and .venv-xla's for xla-cpu), then for each
round and target runs the same ``xbridge run`` twice, fresh and warm, in alternating order (neither always runs on a
cooler machine), each to completion, and times the whole command from this process (wall seconds: the start, the
imports, the run). Both runs of a pair must end with the same final loss. Prints each target's median fresh and warm
seconds and their ratio, writes warm_start.json. The compile caches are one folder for the whole bench, warmed by a
first run of each target that is not timed: a pair compares the start, not a cold compile against a warm one.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))
from machine import describe  # noqa: E402

from xbridge.environments import locate  # noqa: E402
from xbridge.processes import warm  # noqa: E402


def one(cmd: list[str], env: dict[str, str], warm_start: bool) -> tuple[float, float]:
    """Wall seconds and the final loss of one run."""
    began = time.perf_counter()
    done = warm.run(cmd, env, cwd=ROOT) if warm_start else subprocess.run(cmd, capture_output=True, text=True,
                                                                          env={**env, warm.VARIABLE: ""}, cwd=ROOT)
    seconds = time.perf_counter() - began
    if done is None:
        raise SystemExit(f"error: the warm server refused {' '.join(cmd[3:6])}")
    if done.returncode != 0:
        raise SystemExit(f"error: {' '.join(cmd[3:6])} failed: {done.stderr.strip().splitlines()[-1:]}")
    return seconds, json.loads(done.stdout)["summary"]["final_loss"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--program", default="tests/fixtures/hf_zoo.py:resnet")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--backends", default="eager-cpu,inductor-cpu,jax-cpu,xla-cpu")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "warm-start")
    args = parser.parse_args()
    folder = tempfile.mkdtemp(prefix="xbridge-warm-bench-")
    env = {**os.environ, warm.VARIABLE: folder, "XBRIDGE_DEBUG": "0",
           "XBRIDGE_CACHE_DIR": tempfile.mkdtemp(prefix="xbridge-warm-bench-cache-")}
    targets = args.backends.split(",")
    pythons = {target: locate(target).python for target in targets}
    servers = [subprocess.Popen([python, "-m", "xbridge.processes.warm", folder], cwd=ROOT, env=env,
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
               for python in dict.fromkeys(pythons.values())]
    try:
        while not all(warm.socket_path(folder, python).exists() for python in pythons.values()):
            if any(server.poll() is not None for server in servers):
                raise SystemExit("error: a warm server ended before it listened")
            time.sleep(0.2)
        rows = []
        for target in targets:
            cmd = [pythons[target], "-m", "xbridge", "run", args.program, "--backend", target, "--steps",
                   str(args.steps), "--format", "json"]
            one(cmd, env, warm_start=False)         # the compile caches warm for both
            fresh: list[float] = []
            warmed: list[float] = []
            for round_ in range(args.rounds):
                order = (False, True) if round_ % 2 == 0 else (True, False)
                losses = []
                for warm_start in order:
                    seconds, loss = one(cmd, env, warm_start)
                    (warmed if warm_start else fresh).append(seconds)
                    losses.append(loss)
                if losses[0] != losses[1]:
                    raise SystemExit(f"error: {target}: the fresh and the warm run ended at different losses {losses}")
            rows.append({"target": target, "fresh_s": statistics.median(fresh), "warm_s": statistics.median(warmed),
                         "fresh_all_s": fresh, "warm_all_s": warmed})
    finally:
        for server in servers:
            server.terminate()
    print(f"{args.program}, {args.steps} steps, median of {args.rounds} pairs (wall seconds of the whole command)")
    print(f"{'target':14s} {'fresh s':>8s} {'warm s':>8s} {'warm/fresh':>10s}")
    for row in rows:
        row["ratio"] = row["warm_s"] / row["fresh_s"]
        print(f"{row['target']:14s} {row['fresh_s']:8.2f} {row['warm_s']:8.2f} {row['ratio']:10.2f}")
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"machine": describe(), "program": args.program, "steps": args.steps, "rounds": args.rounds,
              "rows": rows, "date": time.strftime("%Y-%m-%d")}
    (args.out / "warm_start.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out / 'warm_start.json'}")


if __name__ == "__main__":
    main()
