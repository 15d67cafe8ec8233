"""Reading what the TPU compiler gave back as text: the collectives of an optimised HLO module, and its refusal when
a program does not fit."""

from __future__ import annotations

import re

_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
          "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1}
KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute", "ragged-all-to-all")
_ARRAY = re.compile(r"\b([a-z]+[0-9a-z]*)\[([0-9,]*)\]")
_OP = re.compile(r"^\s*(?:ROOT\s+)?%?\S+\s*=\s*(.+?)\s+(" + "|".join(KINDS) + r")(-start)?\(", re.M)
# an async start's result: (operands, results, contexts...) for these; all-reduce-start's is its result
_RESULT_IN_TUPLE = {"all-gather", "collective-permute"}


def _arrays(text: str) -> list[int]:
    out = []
    for dtype, dims in _ARRAY.findall(text):
        if dtype in _BYTES:
            n = _BYTES[dtype]
            for d in filter(None, dims.split(",")):
                n *= int(d)
            out.append(n)
    return out


def _top_level(text: str) -> list[str]:
    """``(a, (b, c), d)`` -> ``["a", "(b, c)", "d"]``; a plain shape -> ``[text]``."""
    if not text.startswith("("):
        return [text]
    parts, depth, start = [], 0, 1
    for i, ch in enumerate(text):
        if ch in "({[":
            depth += 1
        elif ch in ")}]":
            depth -= 1
            if depth == 0:
                parts.append(text[start:i])
                break
        elif ch == "," and depth == 1:
            parts.append(text[start:i])
            start = i + 1
    return [p.strip() for p in parts if p.strip()]


def collectives(hlo: str) -> dict[str, dict[str, int]]:
    """Collectives by kind: how many, and the bytes of their results (per chip; an op inside a loop body once,
    not once per trip; an async op counted at its start)."""
    out: dict[str, dict[str, int]] = {}
    for result, kind, start in _OP.findall(hlo):
        pieces = _top_level(result)
        if start and kind in _RESULT_IN_TUPLE and len(pieces) >= 2:
            pieces = [pieces[1]]
        row = out.setdefault(kind, {"count": 0, "bytes": 0})
        row["count"] += 1
        row["bytes"] += sum(sum(_arrays(p)) for p in pieces)
    return out


def custom_calls(hlo: str, target: str = "tpu_custom_call") -> int:
    """How many custom calls to ``target`` (Mosaic kernels: Pallas) the module makes."""
    return hlo.count(f'custom_call_target="{target}"')


_USED = re.compile(r"Used ([0-9.]+)([KMGT]?) of ([0-9.]+)([KMGT]?) hbm")
_ALLOC = re.compile(r"Allocation \(size=(\d+)\) would exceed memory \(size=(\d+)\)")
# libtpu 0.0.50 (jax 0.12): "the total memory required for HLO temporaries (56.01G) exceeds available HBM (15.75G)"
_REQUIRED = re.compile(r"memory required for [^(]*\(([0-9.]+)([KMGT]?)\) exceeds available HBM")
_UNIT = {"": 1, "K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30, "T": 2 ** 40}


def out_of_memory(message: str) -> tuple[str, int | None] | None:
    """The compiler's refusal of a program too large for HBM: (its first line, the bytes it needed where it says),
    or None when ``message`` is another error."""
    if "RESOURCE_EXHAUSTED" not in message and "Ran out of memory" not in message:
        return None
    first = next((line.strip() for line in message.splitlines() if line.strip()), message)
    if m := _USED.search(message):
        return first, int(float(m[1]) * _UNIT[m[2]])
    if m := _ALLOC.search(message):
        return first, int(m[1])
    if m := _REQUIRED.search(message):
        return first, int(float(m[1]) * _UNIT[m[2]])
    return first, None
