"""Compile counts and their causes, read from torch_xla's metrics and debug log: the XLA compilations so far (and
their time, the persistent-cache hits), the graphs Dynamo captured and its guard failures, and the records of
torch_xla's compilation analysis (``PT_XLA_DEBUG_LEVEL=1``): what caused each compilation and where."""

from __future__ import annotations

import os
import re
from collections import Counter
from pathlib import Path
from typing import Any

import torch_xla.debug.metrics as met

import xbridge


def compile_count() -> int:
    data = met.metric_data("CompileTime")
    return int(data[0]) if data else 0


def compile_seconds() -> float:
    """XLA compile time in this process so far (torch_xla's CompileTime metric accumulates nanoseconds)."""
    data = met.metric_data("CompileTime")
    return float(data[1]) / 1e9 if data else 0.0


def persistent_cache_hits() -> int:
    return int(met.counter_value("PersistentCacheHit") or 0)


def dynamo_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def guard_failure_counts() -> dict[Any, int]:
    """How many guard failures Dynamo has recorded so far, per code object (a mark to count the later ones from)."""
    from torch._dynamo.utils import guard_failures

    return {code: len(reasons) for code, reasons in guard_failures.items()}


def guard_failures_since(marks: dict[Any, int]) -> list[str]:
    """Dynamo's guard failures after ``marks`` (:func:`guard_failure_counts`), one line each, named by function."""
    from torch._dynamo.utils import guard_failures

    out = []
    for code, reasons in guard_failures.items():
        name = "the loss" if code.co_name == "loss_of_copies" else code.co_name
        for reason in reasons[marks.get(code, 0):]:
            # "0/1: tensor 'batch['x']' size mismatch ..." -> without the compile id
            out.append(f"{name}: {re.sub(r'^[0-9/]+: ', '', str(reason)).strip()}")
    return out


def debug_offset() -> int:
    """The debug file's size now: the records written after it are the later compilations'."""
    debug = debug_file()
    return debug.stat().st_size if debug is not None and debug.exists() else 0


def xla_reasons(compiles: int, offset: int) -> list[str]:
    """One line per distinct cause of ``compiles`` XLA compilations, from the debug file's records after ``offset``
    (with their count); the compilations torch_xla recorded no cause for, in one line."""
    lines = []
    records = compilation_records(debug_file(), offset)
    for (cause, graph, where), count in Counter(records).items():
        details = ", ".join(([f"graph {graph!r}"] if graph else []) + ([where] if where else []))
        lines.append(f"xla compile x{count}: {cause}" + (f" ({details})" if details else ""))
    if compiles > len(records):
        level = os.environ.get("PT_XLA_DEBUG_LEVEL", "0")
        lines.append(f"xla compile x{compiles - len(records)}: no cause recorded by torch_xla (PT_XLA_DEBUG_LEVEL="
                     f"{level}, PT_XLA_DEBUG_FILE={os.environ.get('PT_XLA_DEBUG_FILE', 'unset')})")
    return lines


def debug_file() -> Path | None:
    """torch_xla's debug file (``PT_XLA_DEBUG_FILE``, set by the backend's configure), where its compilation analysis
    goes; None when unset."""
    name = os.environ.get("PT_XLA_DEBUG_FILE")
    return Path(name) if name else None


_PREFIX = "Compilation Analysis: "
_OWN_CODE = tuple(str(p.resolve()) for p in (Path(xbridge.__file__).parent, Path(__file__).parents[1]))


def _outside_libraries(frame: str) -> bool:
    """A frame line ``fn (/path/file.py:12)`` of code outside torch, torch_xla, the standard library and xbridge."""
    match = re.search(r"\((.*):\d+\)$", frame)
    if not match:
        return False
    path = match.group(1)
    if path.startswith("<"):
        return False
    library = ("/site-packages/torch/", "/site-packages/torch_xla/", "/site-packages/functorch/")
    if any(part in path for part in library) or ("/lib/python3" in path and "/site-packages/" not in path):
        return False
    return not str(Path(path).resolve()).startswith(_OWN_CODE)


def compilation_records(path: Path | None, offset: int) -> list[tuple[str, str, str]]:
    """torch_xla's compilation analysis records written after ``offset`` into ``path``: per compilation its cause,
    graph name and where: the first Python frame outside the libraries (the user's line that forced it), else the
    function of torch_xla's Dynamo bridge that did, else nothing.

    A record, as torch_xla 2.9 writes it (lines prefixed ``Compilation Analysis: ``)::

        Compilation Cause
          most likely user code trying to access tensor value before torch_xla.sync
        Graph Info:
          Graph Name: xbridge-mlp
          ...
        Python Frame Triggered Execution:
          loss (/path/prog.py:12)
          ...
        ----------
    """
    if path is None or not path.exists():
        return []
    with path.open("r", errors="replace") as f:
        f.seek(offset)
        lines = [line[len(_PREFIX):].rstrip() for line in f if line.startswith(_PREFIX)]
    records: list[tuple[str, str, str]] = []
    cause: str | None = None
    graph = where = bridge = ""
    state = ""
    for line in lines:
        body = line.strip()
        if body == "Compilation Cause":
            cause, graph, where, bridge, state = "", "", "", "", "cause"
        elif cause is None:
            continue
        elif state == "cause":
            cause, state = body, ""
        elif body.startswith("Graph Name:"):
            graph = body.split(":", 1)[1].strip()
        elif body.startswith("Python Frame Triggered Execution"):
            state = "frames"
        elif state == "frames" and body and not body.startswith(("---", "===")):
            if not where and _outside_libraries(body):
                where = "at " + body
            elif not bridge and "/torch_xla/_dynamo/" in body:
                bridge = "in torch_xla's Dynamo bridge (" + body.split(" (")[0] + ")"
        elif body.startswith("---"):
            records.append((cause, graph or "", where or bridge or ""))
            cause, state = None, ""
    return records
