"""Collectives of an optimized (TPU) HLO module by kind: count and bytes (result shapes; async *-start ops counted
once, their *-done skipped; ops inside nested computations counted once per appearance, not per loop trip)."""
import re
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
          "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1, "s4": 0.5, "u4": 0.5}
KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute", "ragged-all-to-all")
_SHAPE = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")
_OP = re.compile(r"^\s*(?:ROOT\s+)?%\S+\s*=\s*(.+?)\s+(" + "|".join(KINDS) + r")(-start)?\(", re.M)

def shape_bytes(text: str) -> int:
    total = 0
    for dtype, dims in _SHAPE.findall(text):
        if dtype in _BYTES:
            n = 1
            for d in filter(None, dims.split(",")):
                n *= int(d)
            total += n * _BYTES[dtype]
    return int(total)

def collectives(hlo: str) -> dict:
    out = {}
    for result, kind, start in _OP.findall(hlo):
        # an async start returns (operands, results, ...): count the second half only (the results)
        b = shape_bytes(result)
        if start and result.startswith("("):
            b = b // 2 if kind != "all-gather" else b - b // (1 + 1)  # rough: operand+result tuple
        row = out.setdefault(kind, {"count": 0, "bytes": 0})
        row["count"] += 1
        row["bytes"] += b
    return out

if __name__ == "__main__":
    import sys, json
    print(json.dumps(collectives(open(sys.argv[1]).read()), indent=1))
