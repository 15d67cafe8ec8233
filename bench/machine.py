"""The machine a bench ran on, for its JSON and its table: the CPU's model name and the vector extensions that
change what the compilers do (Inductor probes AVX-512 with bf16 and AMX; the goals hold on one kind of CPU and not
another), the core count and Python's version. Read from /proc/cpuinfo (Linux); elsewhere the platform's name."""

from __future__ import annotations

import os
import platform
import sys

_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile")


def cpu() -> str:
    """``AMD EPYC (avx2 avx512f avx512_bf16)``: the model and which of the notable extensions it has."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8"):
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
                break
    except OSError:
        pass
    have = [flag for flag in _FLAGS if flag in flags]
    return f"{model} ({' '.join(have)})" if have else model


def describe() -> dict[str, object]:
    return {"cpu": cpu(), "cpu_count": os.cpu_count(), "python": sys.version.split()[0]}
