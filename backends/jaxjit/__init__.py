"""The JAX backend: torchax turns the torch module and loss into a JAX function; the whole train step is one
``jax.jit`` with GSPMD shardings from the plan (default) or a ``jax.shard_map`` with explicit collectives
(``sharding_mode="shard_map"``). Targets ``jax-cpu``, ``jax-cuda``, ``jax-tpu``.

This folder is deliberately not called ``jax``: it would shadow the real package.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
from pathlib import Path
from typing import TYPE_CHECKING

from xbridge.contract import Backend, BackendOption, Executable, Target
from xbridge.contract.ahead_of_time import AheadOfTime
from xbridge.contract.checks import Finding, StepChecks
from xbridge.errors import BackendUnavailable, ConfigError, RunError

if TYPE_CHECKING:
    from xbridge import Program, ShardingPlan
    from xbridge.plugin import CompiledProgram, Topology
    from xbridge.torch.op_census import Census

_PLATFORM_PLUGINS = {"tpu": ("libtpu",), "cuda": ("jax_cuda12_plugin", "jax_cuda13_plugin")}
_INSTALL_HINT = {"tpu": "pip install 'jax[tpu]' on a TPU VM", "cuda": "pip install 'xbridge[cuda]' on a CUDA machine"}


def torchax_mismatch() -> str | None:
    """Why the installed torchax cannot run with the installed torch, from their versions alone (importing torchax
    costs seconds): torchax 0.0.13 and earlier name operator overloads torch 2.13 removed, and fail at import."""
    from packaging.version import InvalidVersion, Version

    from xbridge.torch.patches import installed_version

    torch, torchax = installed_version("torch"), installed_version("torchax")
    if torch is None or torchax is None:
        return None
    try:
        old = Version(torchax) < Version("0.0.14.dev0") and Version(torch.split("+", 1)[0]) >= Version("2.13")
    except InvalidVersion:
        return None
    if old:
        return (f"torchax {torchax} does not import on torch {torch} (its operator table names overloads torch 2.13 "
                "removed); install torchax==0.0.14.dev20261026 (pip install 'xbridge[jax]')")
    return None


# what JAX does with host state the forward reads (xbridge/torch/host_state.py), and what to do instead
_HOST_READ = {
    "draw": "JAX traces the step once, and the number drawn while it traces would be a constant of every step; draw "
            "with torch instead (torch.rand and friends: every stack carries them, the same bits on each under --rng "
            "portable)",
    "value": "JAX traces the step once, and the value it sees while it traces would be a constant of every step; "
             "pass what changes in the batch (a tensor), or compute it from the step's tensors",
}
_HOST_READ["data"] = _HOST_READ["value"]
_HOST_READ["stored"] = ("JAX traces the forward more than once (the parameters it reads, the train step, the eval "
                        "step): a tensor the first trace keeps on a module is a value of that trace, which the next "
                        "cannot use (JAX's UnexpectedTracerError); build it in __init__ (register_buffer(..., "
                        "persistent=False)) or compute it in every forward")


class JaxBackend(Backend, AheadOfTime, StepChecks):
    name = "jax"
    devices = ("tpu", "cuda", "cpu")
    requires = ("jax", "optax", "torchax", "torch")
    extra = "jax"
    multi_process = True
    options = (BackendOption("sharding_mode", ("gspmd", "shard_map"), "gspmd",
                             "gspmd: jit with NamedSharding from the plan; shard_map: explicit collectives"),)

    def operator_support(self, census: Census) -> dict[str, str]:
        """torchax's tables for what the forward calls; JAX differentiates the forward's JAX functions itself
        (jax.grad), so torch's backward operators never run here (a user's autograd Function aside, whose backward
        runs as written: the operators it calls are looked up too)."""
        from .ops import support

        called = [use for use in census.ops.values() if use.forward or use.in_user_backward]
        return dict.fromkeys(census.ops, "lowered") | support(called)

    def construct_findings(self, census: Census, program: Program, options: dict[str, str]) -> list[Finding]:
        """JAX traces the whole step with static shapes: a value read on the host or a shape from the data cannot
        be traced (the step fails at its first trace); a user's autograd Function is carried as a custom_vjp."""
        found = [Finding("fails", use.name, use.at, "reads a tensor's value on the host (.item(), `if tensor:`) "
                         "inside the step, which JAX traces without values; compute it with tensor ops "
                         "(torch.where) or outside the loss") for use in census.host_values()]
        found += [Finding("fails", use.name, use.at, "gives a shape that depends on the values, which JAX's static "
                          "shapes cannot trace; use masks, torch.where or topk with a fixed size")
                  for use in census.data_dependent()]
        found += [Finding("note", f"autograd.Function {fn['name']}", fn["where"], "carried as a jax.custom_vjp: "
                          "its own backward runs (a backward that reads a value is refused at init)")
                  for fn in census.functions]
        found += [Finding("fails", read["what"], read["where"] or "(forward)", _HOST_READ[read["kind"]])
                  for read in census.host_reads]
        return found

    def device_reason(self, device: str) -> str | None:
        mismatch = torchax_mismatch()
        if mismatch is not None:
            return mismatch
        if device == "cpu":
            return None
        if device == "tpu":
            from xbridge.plugin import compile_note, tpu_chips_on_this_machine

            if tpu_chips_on_this_machine() == 0:    # known without loading libtpu (which would print and wait)
                return "no TPU chip on this machine's PCI bus" + compile_note("jax-tpu")
        if not any(importlib.util.find_spec(m) for m in _PLATFORM_PLUGINS[device]):
            return (f"jax has no {device.upper()} runtime here (none of {', '.join(_PLATFORM_PLUGINS[device])} "
                    f"is installed; {_INSTALL_HINT[device]})")
        from xbridge.plugin import is_joining

        if is_joining():      # jax.devices() would start the runtime, which must wait for the job
            return None
        import jax

        try:
            jax.devices(device)
        except RuntimeError as exc:
            return f"jax found no {device} device: {str(exc).splitlines()[0]}"
        return None

    def versions(self) -> dict[str, str]:
        return {dist: importlib.metadata.version(dist) for dist in ("jax", "jaxlib", "torchax", "optax", "torch")}

    def device_count(self, device: str) -> int | None:
        if device == "cpu":
            return None  # virtual CPU devices: any count, set before JAX initialises
        import jax

        return len(jax.devices(device))

    def join_processes(self, device: str, devices: int, processes: int | str) -> tuple[int, int]:
        """``jax.distributed.initialize``: the coordinator, the count and this process's index from the environment
        (an xbridge supervisor sets ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``; with
        ``cluster`` and none of them set, JAX's own detection: Slurm, Open MPI, Cloud TPU, Kubernetes). On CPU the
        devices talk through gloo. The global mesh then spans every process's devices."""
        import jax

        from xbridge.plugin import job

        found = job.environment_job()
        if found is None and processes != job.CLUSTER:
            raise ConfigError(f"--processes {processes}: {job.COUNT} and {job.INDEX} are not set in this process's "
                              "environment (the xbridge command that starts the processes sets them)")
        if found is not None and processes != job.CLUSTER and found[1] != processes:
            raise ConfigError(f"--processes {processes}, but {job.COUNT}={found[1]} in the environment")
        kwargs = {} if found is None else {"num_processes": found[1], "process_id": found[0]}
        timeout = job.join_timeout_s()
        address = os.environ.get(job.COORDINATOR)
        if found is not None and found[0] != 0 and address:
            # JAX's client aborts the whole process (SIGABRT, a fatal log line) when the coordinator does not answer
            # in time: wait for it here, where the failure can be one line
            reached = job.wait_for_address(address, timeout)
            if reached is not None:
                raise RunError(f"jax.distributed.initialize could not join the job at coordinator {address} within "
                               f"{timeout} s ({job.JOIN_TIMEOUT}): {reached}")
        try:
            jax.distributed.initialize(**kwargs, initialization_timeout=timeout)   # type: ignore[arg-type]
        except ValueError as exc:       # nothing says where the job is
            raise ConfigError(f"--processes {processes}: no job to join ({str(exc).splitlines()[0]}); JAX looks for "
                              f"Slurm, Open MPI, Cloud TPU or Kubernetes, or {job.COORDINATOR} with {job.COUNT} and "
                              f"{job.INDEX} (docs/multi-process.md)") from None
        except RuntimeError as exc:     # the coordinator cannot be reached: the environment
            raise RunError(f"jax.distributed.initialize could not join the job at coordinator "
                           f"{os.environ.get(job.COORDINATOR, '(from the cluster environment)')} within {timeout} s "
                           f"({job.JOIN_TIMEOUT}): {str(exc).splitlines()[0]}") from None
        self.configure(device, devices)      # this process's devices, before JAX starts its backends
        if device == "cpu":
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        return jax.process_index(), jax.process_count()

    def configure(self, device: str, devices: int, dump: Path | None = None) -> None:
        """Ask for ``devices`` virtual CPU devices before JAX initialises its backends (per process); never fewer
        than this process already asked for (XLA_FLAGS, or an earlier ``jax_num_cpu_devices``)."""
        if device != "cpu":
            return
        import jax

        if not jax.config.jax_platforms:
            # the CPU only: with libtpu installed (xbridge compile) JAX would otherwise load it on its first
            # jax.devices() and print its warnings about a missing TPU (bench/results/tpu-aot/NOTES.md, section 6)
            jax.config.update("jax_platforms", "cpu")
        asked = int(jax.config.jax_num_cpu_devices)  # (-1: not set)
        try:
            jax.config.update("jax_num_cpu_devices", max(devices, _requested_cpu_devices(), asked))
        except RuntimeError:  # already initialised in this process: use what it has
            have = len(jax.devices("cpu"))
            if have < devices:
                raise BackendUnavailable(
                    f"JAX in this process was already initialised with {have} CPU device(s), fewer than --devices "
                    f"{devices}; run in a fresh process or set XLA_FLAGS=--xla_force_host_platform_device_count="
                    f"{devices} before JAX starts") from None

    def averages_shard_losses(self, options: dict[str, str]) -> bool:
        return options.get("sharding_mode") == "shard_map"   # gspmd takes the loss over the global batch

    def compile_ahead(self, program: Program, plan: ShardingPlan, topology: Topology, options: dict[str, str],
                      dump: Path | None, which: tuple[str, ...]) -> list[CompiledProgram]:
        """The train step, evaluation and initialisation ``run`` builds, compiled for ``topology`` by libtpu's
        compile-only client (ahead_of_time.py)."""
        from . import ahead_of_time

        return ahead_of_time.compile_ahead(program, plan, topology, options["sharding_mode"], dump, which)

    def compiler_versions(self) -> dict[str, str]:
        from xbridge.plugin import libtpu_version

        return {**self.versions(), "libtpu": libtpu_version() or "(TPU_LIBRARY_PATH)"}

    def lower(self, program: Program, plan: ShardingPlan, target: Target, options: dict[str, str]) -> Executable:
        from .executable import JaxExecutable

        return JaxExecutable(program, plan, target, options["sharding_mode"])


def _requested_cpu_devices() -> int:
    """The device count XLA_FLAGS already asks for (so configure never lowers it)."""
    for flag in os.environ.get("XLA_FLAGS", "").split():
        if flag.startswith("--xla_force_host_platform_device_count="):
            try:
                return int(flag.split("=", 1)[1])
            except ValueError:
                return 1
    return 1
