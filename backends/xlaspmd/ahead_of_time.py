"""``xbridge compile`` on torch_xla (``--backend xla-tpu --topology v5e-8``): the SPMD program torch_xla would hand a
TPU for the train step (and the evaluation), compiled for the slice by libtpu's compile-only client through JAX.

torch_xla 2.9 has no compile-only device, so (bench/results/tpu-aot/NOTES.md, section 7):

1. **Trace** (aot_trace.py, a child process): torch_xla runs the executable ``run`` builds on N virtual CPU devices
   (``CPU_NUM_DEVICES=N``, read once when its runtime starts: hence the process) for two steps and hands back the
   steady-state step's HLO module as torch_xla gave it to XLA: sharding annotations, ``buffer_donor``, before any
   partitioning.
2. **Compile** (this module's ``main``, a second child process): the module converted to StableHLO
   (``hlo_to_stablehlo``, the converter of torch_xla's own ``XLA_STABLEHLO_COMPILE`` path), its donated arguments
   marked again (the converter drops ``buffer_donor``; ``jax.buffer_donor`` is what JAX's own donation emits), and
   compiled for the topology's compile-only devices with the options ``PjRtComputationClient::Compile`` sets for a
   sharded program: ``num_replicas=1``, ``num_partitions=N``, ``use_spmd_partitioning``,
   ``allow_spmd_sharding_propagation_to_output={true}``, device assignment 1 x N. Its process has the
   ``LIBTPU_INIT_ARGS`` torch_xla sets on a TPU VM of that generation: libtpu reads them once, when it loads, so
   they can be neither set late in a process that loaded libtpu for another target nor taken back after; a process
   of its own keeps them from every other target (jax-tpu sets other flags).

The parent process loads neither torch_xla's runtime nor libtpu. Initialisation is not compiled: torch_xla has no
program for it (the weights are copied from the host; the optimizer state is created inside the first step's graph).
"""

from __future__ import annotations

import json
import os
import pickle
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from xbridge import errors
from xbridge.errors import BackendUnavailable, ConfigError, LoweringError

if TYPE_CHECKING:
    from xbridge.ir.program import Program
    from xbridge.plugin import CompiledProgram, ShardingPlan, Topology

_TRACE = "xbridge.backends.xlaspmd.aot_trace"
_COMPILE = "xbridge.backends.xlaspmd.ahead_of_time"


def compile_ahead(program: Program, plan: ShardingPlan, topology: Topology, mode: str, dump: Path | None,
                  which: tuple[str, ...]) -> list[CompiledProgram]:
    from xbridge.plugin import TRAIN, CompiledProgram

    if mode != "lazy":
        raise LoweringError(f"xbridge compile --backend xla-tpu traces the lazy mode's step (one XLA graph); "
                            f"--xla-mode {mode} runs the step as several graphs (Dynamo's and the update's)")
    if program.step.attention == "flash":
        raise ConfigError("--attention flash with xbridge compile --backend xla-tpu: the step is traced on CPU "
                          "devices, where torch_xla lowers its Pallas flash kernel with jax's default backend and "
                          "refuses (\"Only interpret mode is supported on CPU backend\"); use attention='auto' or "
                          "'math', or jax-tpu, whose flash kernel compiles for a topology")
    if plan.devices != topology.chips:
        raise BackendUnavailable(f"the plan uses {plan.devices} devices, --topology {topology.asked} has "
                                 f"{topology.chips} chips")
    with tempfile.TemporaryDirectory(prefix="xbridge-xla-tpu-") as scratch:
        work = Path(scratch)
        traced = _trace(program, plan, topology, mode, which, work)
        names = [name for name in which if name in traced["modules"]]
        request = {"topology": topology, "dump": str(dump) if dump is not None else None,
                   "modules": {name: traced["modules"][name]["path"] for name in names}}
        (work / "compile.pkl").write_bytes(pickle.dumps(request))
        env = {**os.environ, **traced["libtpu"]}
        result = _child(_COMPILE, work / "compile.pkl", work / "compiled.json", env, "the TPU compile")
    out = []
    for row in result["programs"]:
        program_row = CompiledProgram(**row)
        # torch_xla's trace (which compiles and runs the steps on the CPU devices) and the conversion to StableHLO
        program_row.lower_s = round(traced["modules"][program_row.name]["trace_s"] + program_row.lower_s, 3)
        out.append(program_row)
    if not any(p.name == TRAIN for p in out):
        raise LoweringError(f"torch_xla gave no train step for program {program.name!r}")
    return out


def _trace(program: Program, plan: ShardingPlan, topology: Topology, mode: str, which: tuple[str, ...],
           work: Path) -> dict[str, Any]:
    """The trace child (aot_trace.py): the program travels as a cloudpickle, a program file's own module by value
    (it was loaded from its path, under a name the child cannot import)."""
    try:
        import cloudpickle  # type: ignore[import-untyped]
    except ImportError:
        raise BackendUnavailable("xbridge compile --backend xla-tpu hands the program to a torch_xla process with "
                                 "cloudpickle, which is not installed (pip install cloudpickle)") from None
    for module in _unimportable_modules():
        cloudpickle.register_pickle_by_value(module)
    generation = int(re.match(r"v(\d+)", topology.chip.generation)[1])   # type: ignore[index]
    request = {"program": program, "plan": plan, "mode": mode, "which": which, "generation": generation,
               "dump": str(work / "dump")}
    with (work / "trace.pkl").open("wb") as f:
        cloudpickle.dump(request, f)
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "CPU_NUM_DEVICES", "PJRT_DEVICE")}
    env["JAX_PLATFORMS"] = "cpu"
    return _child(_TRACE, work / "trace.pkl", work / "traced.json", env, "torch_xla's trace")


def _unimportable_modules() -> list[Any]:
    """Modules this process loaded from a file under a name a fresh interpreter cannot import (program files)."""
    def importable(top: str) -> bool:   # asks the finders (an editable install's too), not sys.modules
        if top in sys.stdlib_module_names or top in sys.builtin_module_names:
            return True
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            try:
                if find is not None and find(top, None) is not None:
                    return True
            except (ImportError, ValueError, TypeError):
                continue
        return False

    found: list[Any] = []
    known: dict[str, bool] = {}
    for name, module in list(sys.modules.items()):
        if module is None or not getattr(module, "__file__", None) or "__main__" in (name, module.__name__):
            continue
        top = name.partition(".")[0]
        if top not in known:
            known[top] = importable(top)
        if not known[top]:
            found.append(module)
    return found


def _child(module: str, request: Path, result: Path, env: dict[str, str], what: str) -> dict[str, Any]:
    env = {**env, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    proc = subprocess.run([sys.executable, "-m", module, str(request), str(result)], env=env, capture_output=True,
                          text=True)
    if not result.exists():
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-12:])
        raise LoweringError(f"{what} process ended without a result (exit code {proc.returncode}):\n{tail}")
    data: dict[str, Any] = json.loads(result.read_text())
    if "error" in data:
        kind = getattr(errors, data["type"], None) if data.get("xbridge") else None
        if isinstance(kind, type) and issubclass(kind, errors.XBridgeError):
            raise kind(data["error"])
        raise LoweringError(f"{what} failed: {data['type']}: {data['error']}")
    return data


# --- the compile process ---------------------------------------------------------------------------------------

_DONORS = re.compile(r"buffer_donor=\{(.*?)\}\s*(?:,\s*[a-z_]+=|$)")


def donors(text: str) -> list[int]:
    """The parameters torch_xla donates: the module header's ``buffer_donor={ (0, {}), (3, {}) }``."""
    header = text.split("\n", 1)[0]
    m = _DONORS.search(header)
    return sorted({int(d) for d in re.findall(r"\((\d+),\s*\{\}\)", m[1])}) if m else []


def to_stablehlo(text: str) -> tuple[bytes, int]:
    """The HLO module as StableHLO bytecode with its donated arguments marked ``jax.buffer_donor``; and how many."""
    from jax._src.interpreters import mlir as jmlir
    from jax._src.lib import _jax
    from jax._src.lib.mlir import ir

    bytecode = _jax.mlir.hlo_to_stablehlo(_jax.hlo_module_from_text(text).as_serialized_hlo_module_proto())
    donated = donors(text)
    if not donated:
        return bytecode, 0
    with jmlir.make_ir_context():
        module = ir.Module.parse(bytecode)
        main: Any = next(op for op in module.body.operations
                    if ir.StringAttr(op.attributes["sym_name"]).value == "main")
        count = len(main.regions[0].blocks[0].arguments)
        attrs = (list(main.attributes["arg_attrs"]) if "arg_attrs" in main.attributes
                 else [ir.DictAttr.get({}) for _ in range(count)])
        marked = []
        for i, attr in enumerate(attrs):
            entries = {named.name: named.attr for named in ir.DictAttr(attr)}  # type: ignore[attr-defined]
            if i in donated:
                entries["jax.buffer_donor"] = ir.BoolAttr.get(True)
            marked.append(ir.DictAttr.get(entries))
        main.attributes["arg_attrs"] = ir.ArrayAttr.get(marked)
        return jmlir.module_to_bytecode(module), len(donated)


def compile_module(name: str, text: str, devices: list[Any], dump: Path | None) -> CompiledProgram:
    """One torch_xla module compiled for ``devices`` with torch_xla's options for a sharded program."""
    import numpy as np
    from jax._src.lib import _jax
    from jax._src.lib import xla_client as xc

    from xbridge.plugin import measure

    start = time.perf_counter()
    bytecode, _ = to_stablehlo(text)
    options = xc.CompileOptions()
    build = options.executable_build_options
    build.num_replicas, build.num_partitions, build.use_spmd_partitioning = 1, len(devices), True
    build.allow_spmd_sharding_propagation_to_output = [True]
    build.device_assignment = xc.DeviceAssignment.create(np.array([[d.id for d in devices]]))
    lowered_s = time.perf_counter() - start
    start = time.perf_counter()
    try:
        executable = devices[0].client.compile(bytecode, executable_devices=_jax.DeviceList(tuple(devices)),
                                               compile_options=options)
    except Exception as exc:  # noqa: BLE001 - out of memory is a result (measure.refused), the rest an error
        return measure.refused(name, f"torch_xla's {name}", lowered_s, time.perf_counter() - start, exc)
    compile_s = time.perf_counter() - start
    optimized = executable.hlo_modules()[0].to_string()
    measure.write_dump(dump, name, {"torch_xla.hlo.txt": text, "tpu.optimized.hlo.txt": optimized})
    return measure.compiled(name, lowered_s, compile_s, executable.get_compiled_memory_stats(),
                            executable.cost_analysis(), optimized)


def compile_all(request: dict[str, Any]) -> list[CompiledProgram]:
    from xbridge.plugin import measure

    topology = request["topology"]
    devices = measure.topology_devices(topology)
    dump = Path(request["dump"]) if request["dump"] else None
    return [compile_module(name, Path(path).read_text(), devices, dump) for name, path in request["modules"].items()]


def main(argv: list[str]) -> int:
    from xbridge.plugin import prepare_process

    request_path, result_path = Path(argv[0]), Path(argv[1])
    try:
        prepare_process()
        programs = compile_all(pickle.loads(request_path.read_bytes()))
        result: dict[str, Any] = {"programs": [asdict(p) for p in programs]}
    except Exception as exc:    # noqa: BLE001 - handed back to the parent as one line, with its type
        result = {"error": str(exc).strip() or type(exc).__name__, "type": type(exc).__name__,
                  "xbridge": isinstance(exc, errors.XBridgeError)}
    result_path.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
