"""A jax-cpu run's start with libtpu installed and without it: nothing on the CPU targets may slow down or print TPU
warnings because libtpu (the TPU compiler `xbridge compile` needs) is present.

    .venv/bin/python bench/libtpu_start.py [--rounds 5] [--out bench/results/tpu-aot]

Measured, each in a fresh process, wall seconds and the number of non-empty stderr lines:

* `xbridge run programs/mlp.py --backend jax-cpu --steps 3 --format json`, WITH libtpu (as installed in the venv)
  and WITHOUT it; the ratio with / without of the medians, and the median of each round's with / without;
* `python -c "import jax; jax.devices()"` (a user's own jax code, without xbridge's `jax_platforms="cpu"`), WITH
  and WITHOUT libtpu, and WITH libtpu under `JAX_PLATFORMS=cpu`.

How libtpu is hidden (for the WITHOUT child only; the venv is not touched): a temporary directory goes first on
that child's PYTHONPATH, holding a package `libtpu/__init__.py` that raises ImportError, and TPU_LIBRARY_PATH is
unset. JAX finds libtpu only through TPU_LIBRARY_PATH or `import libtpu` (jax/_src/cloud_tpu_init.py,
get_tpu_library_path), so it then has no TPU library path and loads no TPU plugin; before timing, a child with each
environment checks that `import libtpu` fails (or succeeds) and what JAX's library path and `pjrt_plugin_loaded("tpu")`
say after `jax.devices()`. (`importlib.util.find_spec("libtpu")` still finds the stand-in: only importing fails.)

All variants run alternately, in a rotating order each round, so that none always meets a cooler or a warmer
machine. JAX_PLATFORMS is removed from every child's environment except the one variant that sets it. Prints a table
(median, min, max wall; stderr lines), writes libtpu_start.json with the machine (CPU model, cores, load average
before and after, date) and the first stderr of each variant.
"""

from __future__ import annotations

import argparse
import datetime
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

RUN = [sys.executable, "-m", "xbridge", "run", "programs/mlp.py", "--backend", "jax-cpu", "--steps", "3",
       "--format", "json"]
DEVICES = [sys.executable, "-c", "import jax; jax.devices()"]
CHECK = r"""
import json, os
out = {}
try:
    import libtpu
    out["import_libtpu"] = "ok: " + str(getattr(libtpu, "__file__", "?"))
except ImportError as exc:
    out["import_libtpu"] = "ImportError: " + str(exc)
from jax._src import cloud_tpu_init
out["jax_tpu_library_path"] = cloud_tpu_init.get_tpu_library_path()
import jax
out["devices"] = [str(d) for d in jax.devices()]
from jax._src.lib import _jax
out["tpu_plugin_loaded"] = bool(_jax.pjrt_plugin_loaded("tpu"))
out["jax_platforms"] = os.environ.get("JAX_PLATFORMS")
print("CHECK " + json.dumps(out))
"""


def machine() -> dict:
    from xbridge.run.summary import cpu_model

    model = cpu_model() or "?"
    import importlib.metadata as md

    versions = {}
    for dist in ("jax", "jaxlib", "libtpu", "torch"):
        try:
            versions[dist] = md.version(dist)
        except md.PackageNotFoundError:
            versions[dist] = None
    return {"cpu_model": model, "cpu_count": os.cpu_count(), "python": sys.version.split()[0], "versions": versions,
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}


def environments(hidden: Path) -> dict[str, dict[str, str]]:
    base = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    without = {k: v for k, v in base.items() if k != "TPU_LIBRARY_PATH"}
    without["PYTHONPATH"] = os.pathsep.join(p for p in (str(hidden), base.get("PYTHONPATH", "")) if p)
    return {"with": base, "without": without, "with, JAX_PLATFORMS=cpu": {**base, "JAX_PLATFORMS": "cpu"}}


def timed(command: list[str], env: dict[str, str]) -> dict:
    start = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT)
    wall = time.perf_counter() - start
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    return {"wall_s": wall, "stderr_lines": len(lines), "returncode": proc.returncode, "stderr": lines}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=str(HERE / "results" / "tpu-aot"))
    args = parser.parse_args()
    about = machine()
    about["load_before"] = list(os.getloadavg())
    with tempfile.TemporaryDirectory(prefix="xbridge-no-libtpu-") as folder:
        hidden = Path(folder)
        (hidden / "libtpu").mkdir()
        (hidden / "libtpu" / "__init__.py").write_text(
            'raise ImportError("libtpu hidden by bench/libtpu_start.py (a stand-in first on PYTHONPATH)")\n')
        envs = environments(hidden)
        checks = {}
        for label, env in envs.items():
            proc = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, env=env, cwd=ROOT)
            found = [line for line in proc.stdout.splitlines() if line.startswith("CHECK ")]
            checks[label] = json.loads(found[-1][6:]) if found else {"error": proc.stderr.strip()[-500:]}
            print(f"check {label}: {checks[label]}", flush=True)
        without = checks["without"]
        if not str(without.get("import_libtpu", "")).startswith("ImportError") or without.get("jax_tpu_library_path") \
                or without.get("tpu_plugin_loaded"):
            raise SystemExit(f"error: libtpu is not hidden in the WITHOUT child: {without}")
        if checks["with"].get("jax_tpu_library_path") is None:
            print("warning: JAX finds no libtpu even WITH it: the comparison measures nothing", flush=True)

        variants = [("xbridge run jax-cpu", "with", RUN), ("xbridge run jax-cpu", "without", RUN),
                    ("import jax; jax.devices()", "with", DEVICES), ("import jax; jax.devices()", "without", DEVICES),
                    ("import jax; jax.devices()", "with, JAX_PLATFORMS=cpu", DEVICES)]
        samples: dict[tuple[str, str], list[dict]] = {(cmd, label): [] for cmd, label, _ in variants}
        for round_ in range(args.rounds):
            shift = round_ % len(variants)
            for command_name, label, command in variants[shift:] + variants[:shift]:
                sample = timed(command, envs[label])
                sample["round"] = round_
                samples[(command_name, label)].append(sample)
                print(f"round {round_}: {command_name:<27} {label:<25} {sample['wall_s']:6.2f} s "
                      f"{sample['stderr_lines']} stderr lines (rc {sample['returncode']})", flush=True)
    about["load_after"] = list(os.getloadavg())

    rows = []
    for command_name, label, _ in variants:
        runs = samples[(command_name, label)]
        walls = [r["wall_s"] for r in runs]
        rows.append({"command": command_name, "libtpu": label, "runs": len(runs),
                     "median_s": statistics.median(walls), "min_s": min(walls), "max_s": max(walls),
                     "stderr_lines": sorted({r["stderr_lines"] for r in runs}),
                     "returncodes": sorted({r["returncode"] for r in runs}),
                     "walls_s": walls, "first_stderr": runs[0]["stderr"][:20]})
    run_with, run_without = samples[("xbridge run jax-cpu", "with")], samples[("xbridge run jax-cpu", "without")]
    ratio = statistics.median(r["wall_s"] for r in run_with) / statistics.median(r["wall_s"] for r in run_without)
    pair = statistics.median(a["wall_s"] / b["wall_s"] for a, b in zip(run_with, run_without))
    dev_with = statistics.median(r["wall_s"] for r in samples[("import jax; jax.devices()", "with")])
    dev_without = statistics.median(r["wall_s"] for r in samples[("import jax; jax.devices()", "without")])

    print()
    print(f"{'command':<28}{'libtpu':<26}{'runs':>5}{'median s':>10}{'min s':>8}{'max s':>8}  stderr lines")
    for row in rows:
        print(f"{row['command']:<28}{row['libtpu']:<26}{row['runs']:>5}{row['median_s']:>10.2f}{row['min_s']:>8.2f}"
              f"{row['max_s']:>8.2f}  {','.join(map(str, row['stderr_lines']))}")
    print(f"xbridge run jax-cpu, with / without libtpu: {ratio:.3f} (medians), {pair:.3f} (median of round pairs)")
    print(f"import jax; jax.devices(), with / without libtpu: {dev_with / dev_without:.3f}")
    print(f"load {about['load_before'][0]:.2f} before, {about['load_after'][0]:.2f} after")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {"machine": about, "hidden_by": "a temporary directory first on the child's PYTHONPATH holding "
              "libtpu/__init__.py that raises ImportError; TPU_LIBRARY_PATH unset", "checks": checks, "rows": rows,
              "ratio_run_with_over_without": ratio, "ratio_run_round_pairs_median": pair,
              "ratio_devices_with_over_without": dev_with / dev_without,
              "samples": {f"{cmd} | {label}": v for (cmd, label), v in samples.items()}}
    (out / "libtpu_start.json").write_text(json.dumps(record, indent=2))
    print(f"wrote {out / 'libtpu_start.json'}")


if __name__ == "__main__":
    main()
