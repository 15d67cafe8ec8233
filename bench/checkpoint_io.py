"""What a checkpoint costs: size, save time and load time against one training step, per backend.

    .venv/bin/python bench/checkpoint_io.py [--program programs/gpt.py] [--backends eager,jax] [--rounds 5]
                                            [--out bench/results/checkpoint]

Each backend runs in its own process. It takes two steps (so the optimizer state exists), then alternates rounds
of one step and one save (state pulled from the device, both files written and fsynced, renamed) and one verified
load (checksums, tensors against the program); the table reports medians and save and load time as a ratio of the
step time measured in the same rounds. Prints a table, writes checkpoint.json.

    .venv/bin/python bench/checkpoint_io.py --processes 2 [--devices 2] [--mesh data=1,model=4]

A sharded save and load by a jax job of P processes on this machine (gloo between the CPU devices): per process,
the bytes it wrote against the whole checkpoint, and how far the save and the load raised its resident memory at
their peak (Linux's VmHWM, reset before each) against the whole checkpoint, beside what gathering the state into
every process (the unsharded ``state_dict`` + ``training_state``, as checkpoints did before) raises it. The load
is ``checkpoint.load`` + ``init`` (which builds the torch module, whole, on every process) + the optimizer state.
Writes sharded.json.

    .venv/bin/python bench/checkpoint_io.py --scaling 1,2,4 [--devices 4] [--mesh data=1,model=4]

The same sharded save and load at each process count, the mesh's ``--devices`` devices in all (``--devices`` /
P per process), one after the other: per count, each process's share and its median save and load time. Writes
sharded_scaling.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import describe  # noqa: E402

HERE = Path(__file__).resolve().parent
TARGET = {"eager": "eager-cpu", "inductor": "inductor-cpu", "jax": "jax-cpu", "xla": "xla-cpu"}


def child(program_path: str, backend: str, rounds: int) -> dict:
    from xbridge import checkpoint
    from xbridge.program_file import load_program
    from xbridge.run.loop import RunOptions
    from xbridge.run.prepare import prepare

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


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def sharded_child(program_path: str, processes: int, devices: int, mesh: str, rounds: int, directory: str) -> dict:
    """One process of a P-process jax job: two steps, then ``rounds`` of (sharded save, sharded load), each
    measured for time and for its tracemalloc peak; then the gathered state's peak for comparison."""
    from xbridge import checkpoint
    from xbridge import processes as job
    from xbridge.contract import ShardedCheckpoint, registry
    from xbridge.ir.mesh import parse_mesh
    from xbridge.program_file import load_program
    from xbridge.run.loop import RunOptions
    from xbridge.run.prepare import prepare, readable

    program = load_program(program_path).replace(mesh=parse_mesh(mesh))
    _, backend = registry.resolve("jax-cpu")
    index, count = backend.join_processes("cpu", devices, processes)
    job.joined(index, count)
    total = devices * count
    prepared = prepare(program, "jax-cpu", RunOptions(steps=2, warmup=1, devices=total, processes=count))
    executable = prepared.executable
    for step in range(2):
        executable.step(program.data.batch(step, program.seed))
    def measured(fn):
        """(fn(), seconds, the process's peak resident memory during the call above its resident memory before:
        Linux's VmHWM, reset by writing 5 to /proc/self/clear_refs)."""
        Path("/proc/self/clear_refs").write_text("5")
        base = _status_kib("VmRSS")
        start = time.perf_counter()
        out = fn()
        return out, time.perf_counter() - start, (_status_kib("VmHWM") - base) * 1024

    # first, while nothing freed is there to reuse: what every process held when checkpoints gathered the state
    _, _, gather_peak = measured(lambda: (executable.state_dict(), executable.training_state()))
    save_s, load_s, save_peak, load_peak = [], [], [], []
    path = None
    info = checkpoint.manifest_info(program, "jax-cpu", total, dict(prepared.plan.mesh), 2, {})
    for i in range(rounds):
        writer = checkpoint.Writer(Path(directory) / f"round{i}", keep=1, start_step=0)    # step 2 each round
        if index == 0:
            writer.lock()

        def save(writer=writer):       # as the run loop saves (xbridge/run/loop.py): in pieces where sharded
            pieces = executable.piece_writer() if isinstance(executable, ShardedCheckpoint) else None
            if pieces is not None:
                return writer.save_pieces(2, pieces, info)
            return writer.save(2, executable.state_dict(), executable.training_state(), info)

        path, seconds, peak = measured(save)
        save_s.append(seconds)
        save_peak.append(peak)

        def load(path=path):
            loaded = checkpoint.load(path, program)
            executable.init(readable(executable, loaded.weights))
            executable.load_training_state(readable(executable, loaded.train))

        _, seconds, peak = measured(load)
        load_s.append(seconds)
        load_peak.append(peak)
    assert path is not None
    manifest = json.loads((path / checkpoint.MANIFEST).read_text())
    mine = f"-{index:05d}-of-"
    return {"process": index, "processes": count, "devices": total, "mesh": mesh,
            "checkpoint_bytes": sum(f["bytes"] for f in manifest["files"].values()),
            "written_bytes": sum(f["bytes"] for n, f in manifest["files"].items() if mine in n or count == 1),
            "save_s": float(np.median(save_s)), "load_s": float(np.median(load_s)),
            "save_peak_bytes": int(max(save_peak)), "load_peak_bytes": int(max(load_peak)),
            "gather_peak_bytes": int(gather_peak), "save_peaks": save_peak, "load_peaks": load_peak,
            "rounds": rounds}


def sharded(args: argparse.Namespace, write: bool = True) -> list[dict]:
    from xbridge import processes as job

    directory = tempfile.mkdtemp(prefix="xbridge-sharded-bench-")
    env = {job.COORDINATOR: f"127.0.0.1:{job.free_port()}", job.COUNT: str(args.processes)}
    command = [sys.executable, __file__, "--program", args.program, "--rounds", str(args.rounds), "--processes",
               str(args.processes), "--devices", str(args.devices), "--mesh", args.mesh, "--child", directory,
               "--sharded-child"]
    try:
        procs = [subprocess.Popen(command, env={**os.environ, **env, job.INDEX: str(i)}, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for i in range(args.processes)]
        outs = [p.communicate(timeout=1800) for p in procs]
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    if any(p.returncode for p in procs):
        for p, (_, err) in zip(procs, outs):
            print(f"process exited {p.returncode}\n{err[-2000:]}", file=sys.stderr)
        sys.exit(1)
    rows = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    mib = 2**20
    print(f"{args.program}: {args.processes} processes x {args.devices} devices, mesh {args.mesh}, checkpoint "
          f"{rows[0]['checkpoint_bytes'] / mib:.1f} MiB")
    print(f"{'process':<9}{'wrote MiB':>11}{'share':>8}{'save ms':>9}{'load ms':>9}{'save peak MiB':>15}"
          f"{'load peak MiB':>15}{'gathered MiB':>14}")
    for r in rows:
        print(f"{r['process']:<9}{r['written_bytes'] / mib:>11.2f}{r['written_bytes'] / r['checkpoint_bytes']:>8.2f}"
              f"{r['save_s'] * 1e3:>9.1f}{r['load_s'] * 1e3:>9.1f}{r['save_peak_bytes'] / mib:>15.2f}"
              f"{r['load_peak_bytes'] / mib:>15.2f}{r['gather_peak_bytes'] / mib:>14.2f}")
    if write:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "sharded.json").write_text(json.dumps({"program": args.program, "rows": rows}, indent=2))
        print(f"wrote {out / 'sharded.json'}")
    return rows


def scaling(args: argparse.Namespace) -> None:
    """:func:`sharded` at each process count of ``--scaling``, the same ``--devices`` in all."""
    counts = [int(text) for text in args.scaling.split(",")]
    if any(count < 1 or args.devices % count for count in counts):
        sys.exit(f"--scaling {args.scaling}: each count must divide --devices {args.devices}")
    runs = {}
    for count in counts:
        runs[count] = sharded(argparse.Namespace(**{**vars(args), "processes": count,
                                                    "devices": args.devices // count}), write=False)
    print(f"\n{'processes':<11}{'MiB each (max)':>16}{'save ms (max)':>15}{'save ms (median)':>18}"
          f"{'load ms (max)':>15}")
    for count, rows in runs.items():
        saves = [r["save_s"] * 1e3 for r in rows]
        print(f"{count:<11}{max(r['written_bytes'] for r in rows) / 2**20:>16.2f}"
              f"{max(saves):>15.1f}{float(np.median(saves)):>18.1f}"
              f"{max(r['load_s'] for r in rows) * 1e3:>15.1f}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sharded_scaling.json").write_text(json.dumps({"program": args.program, "devices": args.devices,
                                                          "mesh": args.mesh, "machine": describe(),
                                                          "runs": {str(k): v for k, v in runs.items()}}, indent=2))
    print(f"wrote {out / 'sharded_scaling.json'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--program", default="programs/gpt.py")
    parser.add_argument("--backends", default="eager,jax")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default="bench/results/checkpoint")
    parser.add_argument("--processes", type=int, default=1, help="> 1: a sharded save and load by a jax job")
    parser.add_argument("--devices", type=int, default=2, help="devices per process (with --processes)")
    parser.add_argument("--mesh", default="data=1,model=4", help="the mesh (with --processes)")
    parser.add_argument("--scaling", help="P,P,...: the sharded save and load at each process count, --devices in "
                                           "all")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--sharded-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.scaling:
        scaling(args)
        return
    if args.child and args.sharded_child:
        print(json.dumps(sharded_child(args.program, args.processes, args.devices, args.mesh, args.rounds,
                                       args.child)))
        return
    if args.child:
        print(json.dumps(child(args.program, args.child, args.rounds)))
        return
    if args.processes > 1:
        sharded(args)
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
