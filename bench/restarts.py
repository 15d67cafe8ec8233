"""Restarts (``--max-restarts``): what a killed process costs a job, by checkpoint interval.

    .venv/bin/python bench/restarts.py [--program gpt] [--steps 12] [--kill-at 7] [--intervals 2,4,8]
                                       [--name restarts] [--out bench/results/restarts]
    .venv/bin/python bench/restarts.py --processes 4 --devices 1 --kill 2,3 --name host     # a host of 2 lost
    .venv/bin/python bench/restarts.py --backend inductor-cpu --processes 1 --kill 1 --name inductor

For each checkpoint interval, on jax-cpu with 2 processes x 2 devices: the job uninterrupted, then the same job with
process 1 SIGKILLed when its data source is asked for step K's rows (tests/fixtures/restart_fault.py; step K is
fetched while step K-1 runs) and ``--max-restarts 1``. Reported per interval: both wall times, their difference
(what the kill cost the job), the step the restart resumed from and the steps redone (from the restarted job's
record), the steady step time, and the restart itself: the difference less the redone steps at the steady step
time (stopping the others, starting every process, joining, compiling, reading the checkpoint). An untimed
uninterrupted job runs first, so that every timed one finds the compile caches warm. Both runs must
give the same losses bit for bit (a restart that changed the training would make its timing meaningless). Prints a
table, writes NAME.json (--name, default restarts) in --out.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from machine import cpu, describe  # noqa: E402

FIXTURE = ROOT / "tests" / "fixtures" / "restart_fault.py"


def one_job(program: str, steps: int, every: int, kill_at: int, fault: str, args: argparse.Namespace) -> dict:
    env = dict(os.environ, XBRIDGE_TEST_FAULT=fault, XBRIDGE_TEST_FAULT_STEP=str(kill_at),
               XBRIDGE_TEST_FAULT_PROCESSES=args.kill)
    spread = ["--processes", str(args.processes)] if args.processes > 1 else []
    with tempfile.TemporaryDirectory(prefix="xbridge-bench-restarts-") as folder:
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "xbridge", "run", f"{FIXTURE}:{program}", "--backend",
                               args.backend, *spread, "--devices", str(args.devices), "--steps", str(steps),
                               "--checkpoint-every",
                               str(every), "--checkpoint-dir", str(Path(folder) / "ckpt"), "--max-restarts", "1",
                               "--format", "json"], capture_output=True, text=True, env=env, cwd=ROOT)
        wall = time.perf_counter() - start
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["?"])[-1], "wall_s": wall}
    record = json.loads(proc.stdout)
    return {"wall_s": wall, "losses": [s["loss"] for s in record["steps"]], "restarts": record["restarts"],
            "step_s": record["summary"]["step_time_median_s"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--program", default="gpt", help="gpt or program (the MLP) of tests/fixtures/restart_fault.py")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--kill-at", type=int, default=7)
    parser.add_argument("--intervals", default="2,4,8")
    parser.add_argument("--backend", default="jax-cpu", help="jax-cpu (with --processes) or inductor-cpu (its ranks)")
    parser.add_argument("--processes", type=int, default=2, help="jax: the processes of the job (1: inductor)")
    parser.add_argument("--devices", type=int, default=2, help="devices per process (inductor: its ranks)")
    parser.add_argument("--kill", default="1", help="the processes (or inductor ranks) killed, e.g. 2,3: a host of 2")
    parser.add_argument("--name", default="restarts", help="the JSON file's name in --out")
    parser.add_argument("--out", default=str(HERE / "results" / "restarts"))
    args = parser.parse_args()
    rows = []
    print(f"on {cpu()}, {os.cpu_count()} cores; {args.program} on {args.backend}, {args.processes} process(es) x "
          f"{args.devices} devices, {args.steps} steps, process(es) {args.kill} killed at step {args.kill_at}",
          flush=True)
    print(f"{'every':>6}{'whole s':>9}{'killed s':>10}{'cost s':>8}{'from':>6}{'redone':>8}{'step s':>8}"
          f"{'restart s':>11}{'same losses':>13}", flush=True)
    intervals = [int(x) for x in args.intervals.split(",") if x.strip()]
    # one uninterrupted job first, not timed: it fills the compile caches, so every timed job starts warm (a
    # restarted process finds what the first start compiled; a cold first job made a kill look cheaper)
    one_job(args.program, args.steps, intervals[0], args.kill_at, "off", args)
    for every in intervals:
        whole = one_job(args.program, args.steps, every, args.kill_at, "off", args)
        killed = one_job(args.program, args.steps, every, args.kill_at, "once", args)
        row: dict = {"every": every, "whole": whole, "killed": killed}
        if "error" in whole or "error" in killed:
            row["error"] = whole.get("error") or killed.get("error")
            print(f"{every:>6} error: {row['error']}", flush=True)
            rows.append(row)
            continue
        (restart,) = killed["restarts"]
        cost = killed["wall_s"] - whole["wall_s"]
        row.update(cost_s=cost, from_step=restart["from_step"], steps_redone=restart["steps_redone"],
                   step_s=whole["step_s"], restart_s=cost - restart["steps_redone"] * whole["step_s"],
                   same_losses=killed["losses"] == whole["losses"])
        rows.append(row)
        print(f"{every:>6}{whole['wall_s']:>9.1f}{killed['wall_s']:>10.1f}{cost:>8.1f}{restart['from_step']:>6}"
              f"{restart['steps_redone']:>8}{whole['step_s']:>8.2f}{row['restart_s']:>11.1f}"
              f"{str(row['same_losses']):>13}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {"program": args.program, "steps": args.steps, "kill_at": args.kill_at, "backend": args.backend,
              "processes": args.processes, "devices": args.devices, "killed": args.kill, "machine": describe(),
              "rows": rows}
    (out / f"{args.name}.json").write_text(json.dumps(record, indent=2))
    print(f"wrote {out / f'{args.name}.json'}")


if __name__ == "__main__":
    main()
