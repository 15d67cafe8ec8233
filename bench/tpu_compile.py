"""`xbridge compile` over a set of programs and TPU topologies, on this CPU machine (no TPU runs anything).

    .venv/bin/python bench/tpu_compile.py [--cases 0,3,gpt-v5e8-flash] [--list] [--timeout 900]
                                          [--out bench/results/tpu-aot] [--markdown] [--render compile.json]

Each case is one `xbridge compile PROG --backend B --topology T [options] --format json` in its own subprocess, one
at a time (a compile takes one or two cores; two at once would slow both and blur the timings). Reported per case,
from the compile record: the options (precision, attention, sharding or xla mode, scanned layers) and the mesh; per
chip, the bytes the train step needs against the chip's HBM, whether every compiled program fits, and the
evaluation's bytes; the train step's lower + compile seconds and the process's wall seconds; the roofline lower
bound on the step time and the MFU ceiling it allows (both ESTIMATES from datasheet peaks: nothing ran on a TPU);
the train step's collectives (kind x count). A case that fails is a row with its one error line. Prints a table,
writes compile.json (every record, the machine: CPU model, cores, load average before and after, date, versions).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
GPT, ZOO = "programs/gpt.py", "tests/fixtures/hf_zoo.py"
BF16 = ["--precision", "bf16-mixed"]

# (name, program, backend, topology, extra arguments)
CASES: list[tuple[str, str, str, str, list[str]]] = [
    ("gpt-v5e8", GPT, "jax-tpu", "v5e-8", BF16),
    ("gpt-v5e8-flash", GPT, "jax-tpu", "v5e-8", BF16 + ["--attention", "flash"]),
    ("gpt-v6e8-flash", GPT, "jax-tpu", "v6e-8", BF16 + ["--attention", "flash"]),
    ("gpt-v5e8-tp2", GPT, "jax-tpu", "v5e-8", BF16 + ["--mesh", "data=-1,model=2"]),
    ("gpt-v5p128-b64", GPT, "jax-tpu", "v5p-128", BF16 + ["--batch", "64"]),
    # the issue's own command: the program's precision (fp32)
    ("gpt-v5e8-fp32-flash", GPT, "jax-tpu", "v5e-8", ["--attention", "flash"]),
    ("gpt-v5e8-shardmap-flash", GPT, "jax-tpu", "v5e-8", BF16 + ["--sharding-mode", "shard_map",
                                                                 "--attention", "flash"]),
    ("gpt-xla-v5e4", GPT, "xla-tpu", "v5e-4", BF16),
    ("llama-v5e4", f"{ZOO}:llama", "jax-tpu", "v5e-4", BF16),
    ("moe_sharded-v6e4", f"{ZOO}:moe_sharded", "jax-tpu", "v6e-4", BF16),
    ("bert-v6e4", f"{ZOO}:bert", "jax-tpu", "v6e-4", BF16),
    ("resnet-v5e4", f"{ZOO}:resnet", "jax-tpu", "v5e-4", BF16),
    ("llama_scanned-v5e8-shardmap", f"{ZOO}:llama_scanned", "jax-tpu", "v5e-8", BF16 + ["--sharding-mode",
                                                                                       "shard_map"]),
    ("wide_mlp_huge-v5e4", "tests/fixtures/wide_mlp.py:huge", "jax-tpu", "v5e-4", []),   # does not fit
]
TRAIN, EVAL = "train step", "evaluation"
GIB = 2 ** 30


def machine() -> dict:
    from xbridge.run.summary import cpu_model

    model = cpu_model() or "?"
    return {"cpu_model": model, "cpu_count": os.cpu_count(), "python": sys.version.split()[0],
            "platform": platform.platform(), "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}


def error_line(stderr: str) -> str:
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    return (errors or lines or ["(no output)"])[-1]


def one_case(case: tuple[str, str, str, str, list[str]], timeout: float) -> dict:
    name, program, backend, topology, extra = case
    command = [sys.executable, "-m", "xbridge", "compile", program, "--backend", backend, "--topology", topology,
               *extra, "--format", "json"]
    row: dict = {"case": name, "program": program, "target": backend, "topology": topology, "arguments": extra,
                 "command": "xbridge " + " ".join(command[3:]), "load_before": os.getloadavg()[0]}
    start = time.perf_counter()
    try:
        proc = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=timeout)
    except subprocess.TimeoutExpired:
        row.update(wall_s=time.perf_counter() - start, error=f"timed out after {timeout:.0f} s")
        return row
    row["wall_s"] = time.perf_counter() - start
    row["returncode"] = proc.returncode
    try:
        record = json.loads(proc.stdout)
    except json.JSONDecodeError:
        record = None
    if record is None or record.get("kind") != "xbridge.compile":
        row["error"] = error_line(proc.stderr)
        return row
    row["record"] = record
    if proc.returncode != 0:
        row["error"] = error_line(proc.stderr)
    return row


def gib(value) -> str:
    return "-" if value is None else f"{value / GIB:.3f}"


def summary(row: dict) -> dict:
    """The table's cells for one case (strings)."""
    cells = {"case": row["case"], "program": row["program"].rsplit("/", 1)[-1], "target": row["target"],
             "topology": row["topology"], "chips": "-",
             "precision": "-", "attention": "-", "mode": "-", "scan": "-", "mesh": "-", "need": "-", "hbm": "-",
             "fits": "-", "eval": "-", "train_s": "-", "wall": f"{row['wall_s']:.1f}", "step_ms": "-", "mfu": "-",
             "collectives": "-"}
    record = row.get("record")
    if record is None:
        return cells
    options, per_chip = record["options"], record["per_chip"]
    train, evaluation = per_chip.get(TRAIN, {}), per_chip.get(EVAL, {})
    cells.update(chips=str(record["topology"]["chips"]), precision=str(options.get("precision")),
                 attention=str(options.get("attention")),
                 mode=str(options.get("sharding_mode") or options.get("xla_mode") or "-"),
                 scan="yes" if options.get("scan_layers") else "no",
                 mesh=",".join(f"{k}={v}" for k, v in record["mesh"].items()),
                 need=gib(train.get("need_bytes")), hbm=gib(record["topology"]["chip"]["hbm_bytes"]),
                 fits="yes" if record["fits"] else "NO", eval=gib(evaluation.get("need_bytes")))
    if train.get("refused"):
        cells["need"] += " (refused)"
    if train.get("lower_s") is not None:
        cells["train_s"] = f"{train['lower_s'] + train['compile_s']:.1f}"
    roof = record.get("roofline")
    if roof:
        cells["step_ms"] = f"{roof['step_s'] * 1e3:.3f}"
        cells["mfu"] = "-" if roof.get("mfu_ceiling") is None else f"{100 * roof['mfu_ceiling']:.1f}%"
    collectives = train.get("collectives") or {}
    cells["collectives"] = ", ".join(f"{kind} x{c['count']}" for kind, c in sorted(collectives.items())) or "none"
    return cells


COLUMNS = [("case", "case", "<", 28), ("program", "program", "<", 24), ("target", "target", "<", 8),
           ("topology", "topology", "<", 9),
           ("chips", "chips", ">", 6), ("precision", "precision", "<", 11), ("attention", "attention", "<", 10),
           ("mode", "mode", "<", 10), ("scan", "scan", "<", 5), ("mesh", "mesh", "<", 22),
           ("need", "train GiB/chip", ">", 15), ("hbm", "HBM GiB", ">", 8), ("fits", "fits", ">", 5),
           ("eval", "eval GiB", ">", 9), ("train_s", "train lower+compile s", ">", 22), ("wall", "wall s", ">", 7),
           ("step_ms", "step ms (estimate)", ">", 19), ("mfu", "MFU ceiling (estimate)", ">", 23),
           ("collectives", "train collectives", "<", 0)]


def print_header() -> None:
    print("".join(f"{title:{align}{width}}" + (" " if width else "") for _, title, align, width in COLUMNS),
          flush=True)


def print_row(row: dict) -> None:
    cells = summary(row)
    print("".join(f"{cells[key]:{align}{width}}" + (" " if width else "") for key, _, align, width in COLUMNS),
          flush=True)
    if "error" in row:
        print(f"    {row['case']}: {row['error']}", flush=True)


def markdown(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(title for _, title, _, _ in COLUMNS) + " |",
             "| " + " | ".join("---" if align == "<" else "---:" for _, _, align, _ in COLUMNS) + " |"]
    for row in rows:
        cells = summary(row)
        lines.append("| " + " | ".join(cells[key] for key, _, _, _ in COLUMNS) + " |")
    errors = [f"* {row['case']}: `{row['error']}`" for row in rows if "error" in row]
    return "\n".join(lines + ([""] + errors if errors else []))


def select(spec: str | None) -> list[tuple[str, str, str, str, list[str]]]:
    if not spec:
        return list(CASES)
    names = {case[0]: case for case in CASES}
    chosen = []
    for item in (s.strip() for s in spec.split(",") if s.strip()):
        if item.isdigit() and int(item) < len(CASES):
            chosen.append(CASES[int(item)])
        elif item in names:
            chosen.append(names[item])
        else:
            raise SystemExit(f"error: unknown case {item!r}; cases: "
                             + ", ".join(f"{i}:{c[0]}" for i, c in enumerate(CASES)))
    return chosen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", help="comma-separated indices or names (default: all); --list shows them")
    parser.add_argument("--list", action="store_true", help="list the cases and exit")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per case before it counts as failed")
    parser.add_argument("--out", default=str(HERE / "results" / "tpu-aot"))
    parser.add_argument("--markdown", action="store_true", help="also print the table as markdown at the end")
    parser.add_argument("--render", metavar="JSON", help="compile nothing: print the table of an earlier compile.json")
    args = parser.parse_args()
    if args.render:
        rows = json.loads(Path(args.render).read_text())["rows"]
        print_header()
        for row in rows:
            print_row(row)
        print()
        print(markdown(rows))
        return
    if args.list:
        for i, (name, program, backend, topology, extra) in enumerate(CASES):
            print(f"{i:>3} {name:<28} {program} --backend {backend} --topology {topology} {' '.join(extra)}")
        return
    cases = select(args.cases)
    about = machine()
    about["load_before"] = list(os.getloadavg())
    print(f"{about['cpu_model']}, {about['cpu_count']} cores, load {about['load_before'][0]:.2f}; "
          "nothing runs on a TPU: step time and MFU are roofline estimates from datasheet peaks", flush=True)
    print_header()
    rows = []
    for case in cases:
        row = one_case(case, args.timeout)
        rows.append(row)
        print_row(row)
    about["load_after"] = list(os.getloadavg())
    versions = sorted({json.dumps(row["record"]["versions"], sort_keys=True) for row in rows if "record" in row})
    about["versions"] = [json.loads(v) for v in versions]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "compile.json").write_text(json.dumps({"machine": about, "rows": rows}, indent=2))
    print(f"load {about['load_before'][0]:.2f} before, {about['load_after'][0]:.2f} after; "
          f"wrote {out / 'compile.json'}", flush=True)
    if args.markdown:
        print()
        print(markdown(rows))


if __name__ == "__main__":
    main()
