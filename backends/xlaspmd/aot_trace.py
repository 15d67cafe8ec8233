"""The trace half of ``xbridge compile --backend xla-tpu`` (ahead_of_time.py): in a process of its own, torch_xla
runs the executable ``run`` builds (``XlaBackend.lower``, ``XlaExecutable.init`` and ``step``) on N virtual CPU
devices, N the slice's chips, with XLA's dump on, and hands back the HLO modules torch_xla compiled for the steady-state
train step and the evaluation: each one exactly as torch_xla gave it to XLA (``before_optimizations``: sharding
annotations, ``buffer_donor``, ``num_partitions=N``), before any partitioning for the CPU.

Why a process of its own: torch_xla's CPU runtime reads ``CPU_NUM_DEVICES`` (and ``XLA_FLAGS``, for the dump) once,
when it starts, and SPMD spans every device of the process, so N devices need a fresh process; and the TPU compile
that follows loads libtpu with torch_xla's own ``LIBTPU_INIT_ARGS``, which libtpu also reads once per process.

The steady-state step: the graph that takes the optimizer state as arguments and donates it, which is what every
later step runs. The executable creates the state before step 0 (xbridge/torch/optimizer_state.py), so the first
step's graph is it; an SGD with dampening still creates its state inside the first step, and the second step's graph
is the steady one. Both steps run (the trace cannot stop at the compile): on the CPU devices, once each.

Run as ``python -m xbridge.backends.xlaspmd.aot_trace REQUEST RESULT``: REQUEST is a cloudpickle of
``{program, plan, mode, which, generation, dump}``, RESULT the JSON written back.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

TRAIN, EVAL = "train step", "evaluation"     # xbridge.aot.record's names (imported lazily there)
_SUFFIX = ".before_optimizations.txt"


def _modules(dump: Path) -> set[Path]:
    return {p for p in dump.glob(f"module_*{_SUFFIX}")}


def _steady(new: list[Path], graph: str, when: str) -> Path:
    """The one module named ``graph`` among those compiled during a step."""
    named = [p for p in new if f".{graph}." in p.name]
    if len(named) != 1:
        from xbridge.errors import LoweringError

        raise LoweringError(f"torch_xla compiled {len(named)} graphs named {graph!r} during the {when} "
                            f"({', '.join(p.name for p in new) or 'none'}); xbridge compile --backend xla-tpu compiles "
                            "a step that is one XLA graph")
    return named[0]


def libtpu_init_args(generation: int) -> dict[str, str]:
    """The libtpu settings torch_xla makes on a TPU VM of ``generation`` (torch_xla/__init__.py,
    ``_setup_default_env``), from torch_xla's own function with the generation it would read from the VM's metadata
    given; the user's ``LIBTPU_INIT_ARGS`` are kept, as torch_xla keeps them. This process's environment is left as
    it was."""
    import torch_xla

    from . import patches

    saved = os.environ.get("LIBTPU_INIT_ARGS")
    try:
        with patches.tpu_generation(generation):
            torch_xla._setup_libtpu_flags()
        out = {"LIBTPU_INIT_ARGS": os.environ["LIBTPU_INIT_ARGS"].strip()}
    finally:
        if saved is None:
            os.environ.pop("LIBTPU_INIT_ARGS", None)
        else:
            os.environ["LIBTPU_INIT_ARGS"] = saved
    if generation == 4:
        out["TPU_MEGACORE"] = os.environ.get("TPU_MEGACORE", "megacore_dense")
    return out


def trace(request: dict[str, Any]) -> dict[str, Any]:
    from xbridge.contract import Target
    from xbridge.plugin import checked_batch
    from xbridge.torch.weights import initial_weights

    from . import XlaBackend

    program, plan, mode, which = request["program"], request["plan"], request["mode"], request["which"]
    dump = Path(request["dump"])
    backend = XlaBackend()
    backend.configure("cpu", plan.devices, dump)      # PJRT_DEVICE=CPU, CPU_NUM_DEVICES=N, --xla_dump_to
    start = time.perf_counter()
    executable = backend.lower(program, plan, Target("xla", "cpu"), {"xla_mode": mode})
    executable.init(initial_weights(program))
    graph = f"xbridge-{program.name}"
    out: dict[str, Any] = {"modules": {}, "setup_s": round(time.perf_counter() - start, 3)}
    seen = _modules(dump)
    start = time.perf_counter()
    for step in (0, 1):
        executable.step(checked_batch(program.data, step, program.seed))
        new = sorted(_modules(dump) - seen)
        seen |= set(new)
        if step == 0:
            first = _steady(new, graph, "first step")
        elif not [p for p in new if f".{graph}." in p.name]:
            new = [first]           # the first step's graph is already the steady one (no optimizer state)
    out["modules"][TRAIN] = {"path": str(_steady(new, graph, "second step")),
                             "trace_s": round(time.perf_counter() - start, 3)}
    if EVAL in which:
        data = program.eval.data if program.eval is not None else program.data
        start = time.perf_counter()
        executable.evaluate(executable.put(checked_batch(data, 0, program.seed)))
        new = sorted(_modules(dump) - seen)
        if new:        # the loss in eval mode, one lazy graph (the largest, should a transfer compile beside it)
            out["modules"][EVAL] = {"path": str(max(new, key=lambda p: p.stat().st_size)),
                                    "trace_s": round(time.perf_counter() - start, 3)}
    out["libtpu"] = libtpu_init_args(request["generation"])
    return out


def main(argv: list[str]) -> int:
    import cloudpickle  # type: ignore[import-untyped]

    request_path, result_path = Path(argv[0]), Path(argv[1])
    with request_path.open("rb") as f:
        request = cloudpickle.load(f)
    try:
        result: dict[str, Any] = trace(request)
    except Exception as exc:    # noqa: BLE001 - handed back to the parent as one line, with its type
        from xbridge.errors import XBridgeError

        result = {"error": str(exc).strip() or type(exc).__name__, "type": type(exc).__name__,
                  "xbridge": isinstance(exc, XBridgeError)}
    result_path.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
