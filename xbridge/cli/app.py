"""The ``xbridge`` command and its subcommands. Bad input prints one ``error:`` line and exits 2;
``XBRIDGE_DEBUG=1`` shows tracebacks.

Backend options (``--sharding-mode``, ``--xla-mode``, ...) are not written here: each backend declares its own
(xbridge.contract.BackendOption), ``run`` accepts exactly the declared flags, and the core checks their values."""

from __future__ import annotations

import dataclasses
import difflib
import errno
import json
import os
import sys
from enum import StrEnum
from pathlib import Path
from typing import Any

import click
import typer
from typer.core import TyperCommand

from ..errors import ConfigError, XBridgeError
from ..files import check_file_writable, check_writable, read_npz, write_json

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Write a PyTorch training program once; run, match and race it on every compiler stack.")


class Format(StrEnum):
    human = "human"
    json = "json"


# Options several commands take, declared once.
PROGRAM = typer.Argument(..., help="Program file (defines `program = xb.Program(...)`), or FILE.py:NAME.")
TARGET_DEVICES = typer.Option(1, help="Devices for sharded targets (eager always uses 1); with --processes, per "
                              "process.")
TARGET_PROCESSES = typer.Option(1, "--processes", help="jax targets run as P processes of --devices each; the other "
                                "sharded targets run P x --devices in one process (docs/multi-process.md).")
MESH = typer.Option(None, help="Override the program's mesh, e.g. data=-1,model=2.")
PROCESSES = typer.Option(None, "--processes", help="jax targets: spread the run over P processes on this machine, "
                         "--devices each (the mesh spans all of them), or 'cluster': join the job a cluster launcher "
                         "started (docs/multi-process.md).")
FORMAT = typer.Option(Format.human, "--format", help="human: tables for a person; json: one JSON document on stdout.")
TIMEOUT = typer.Option(900.0, help="Seconds before a target's process is stopped and reported as a timeout.")
RNG = typer.Option(None, "--rng", help="Where the forward's random draws (dropout, torch.rand...) come from: "
                   "native (each stack's own generator) or portable (the same bits on every backend). Default: the "
                   "program's StepOptions(rng=...), native unless it says otherwise.")
TENSORBOARD = typer.Option(None, "--tensorboard", help="Write each step's loss, learning rate, step time and tokens/s "
                           "(and eval loss) as TensorBoard event files here; compare: one subfolder per target. "
                           "Needs xbridge[tensorboard].")
PROFILE = typer.Option(None, "--profile", help="Trace steps A..B-1 with the stack's own profiler (torch.profiler, "
                       "jax.profiler, torch_xla's), e.g. steps=5:8; the trace goes under --out DIR/profile and a "
                       "summary of the top operations into the record.")
REMAT = typer.Option(None, "--remat", help="Activation checkpointing of the model's layers: none, full (each layer "
                     "recomputed in the backward pass) or dots (matmul outputs kept). Default: the program's "
                     "StepOptions(remat=...).")
ATTENTION = typer.Option(None, "--attention", help="The kernel every scaled_dot_product_attention call must use: "
                         "auto, math, flash, efficient or cudnn; one the target cannot run is refused. Default: the "
                         "program's StepOptions(attention=...), auto.")
REFERENCE_OPTION = typer.Option("eager-cpu", "--reference", help="The eager target the others are checked against "
                                                                 "(eager-cuda on a GPU machine).")


def _load(program_path: str, precision: str | None = None, seed: int | None = None, mesh: str | None = None,
          rng: str | None = None, remat: str | None = None, attention: str | None = None) -> Any:
    from ..ir.mesh import parse_mesh
    from ..program_file import load_program

    program = load_program(program_path)
    changes: dict[str, Any] = {}
    if mesh is not None:
        changes["mesh"] = parse_mesh(mesh)
    if precision is not None:
        changes["precision"] = precision
    if seed is not None:
        changes["seed"] = seed
    from ..ir.program import ATTENTION_KERNELS, REMAT_MODES, RNG_MODES

    step: dict[str, Any] = {}       # the flags that override a StepOptions field, each checked against its choices
    for name, value, choices in (("rng", rng, RNG_MODES), ("remat", remat, REMAT_MODES),
                                 ("attention", attention, ATTENTION_KERNELS)):
        if value is not None:
            if value not in choices:
                raise ConfigError(f"--{name} must be one of {', '.join(choices)}, got {value!r}")
            step[name] = value
    if step:
        changes["step"] = dataclasses.replace(program.step, **step)
    return program.replace(**changes) if changes else program


def _target_list(backends: str | None) -> list[str] | None:
    if backends is None:
        return None
    targets = [t.strip() for t in backends.split(",") if t.strip()]
    if not targets:
        raise ConfigError("--backends names no target; give some (e.g. --backends jax-cpu,xla-cpu), or leave it out "
                          "for every target available here")
    return targets


def _backend_options(ctx: typer.Context) -> dict[str, str]:
    """``--NAME VALUE`` / ``--NAME=VALUE`` pairs left over by the fixed options: each must be an option some
    installed backend declares (its values are checked against the target's own options later)."""
    from ..contract.registry import all_options

    declared = all_options()
    given: dict[str, str] = {}
    items = iter(ctx.args)
    for item in items:
        flag, sep, value = item.partition("=")
        name = flag[2:].replace("-", "_") if flag.startswith("--") else ""
        if name not in declared:
            if not flag.startswith("-"):
                raise ConfigError(f"Got unexpected extra argument ({item}) (see `{ctx.command_path} --help`)")
            flags = [o for p in ctx.command.params for o in p.opts] + [o.flag for o in declared.values()]
            close = difflib.get_close_matches(flag, flags, n=1)
            hint = f" Did you mean {close[0]}?" if close else ""
            raise ConfigError(f"No such option: {flag}.{hint} (see `{ctx.command_path} --help`)")
        if not sep:
            value = next(items, "")
            if not value or value.startswith("--"):
                raise ConfigError(f"option {flag} needs a value ({', '.join(declared[name].choices)})")
        given[name] = value
    return given


def _options_epilog() -> list[str]:
    """The backend options, for ``run --help``: read from the installed backends' declarations."""
    from ..contract import registry

    lines = []
    for name in registry.backend_names():
        backend = registry.load(name).backend
        for option in backend.options if backend is not None else ():
            lines.append(f"{option.flag} {{{'|'.join(option.choices)}}} ({name} only; default {option.default}): "
                         f"{option.help}")
    return lines


class _WithBackendOptions(TyperCommand):
    """``run --help`` ends with the options the installed backends declare (read only when help is shown)."""

    def format_help(self, ctx: Any, formatter: Any) -> None:
        super().format_help(ctx, formatter)     # typer prints its rich help itself
        lines = _options_epilog()
        if lines:
            click.echo("\n Backend options (checked against the target's own):")
            for line in lines:
                click.echo(f"   {line}")


def _over_targets(command: str, program_path: str, out: Path, format: Format, **fields: Any) -> None:
    """What compare and parity share: their options (``xbridge.<command>.job.<Command>Options`` from the command's
    fields, targets from --backends), the program with the overrides, --out checked before any work, the job
    (``xbridge.<command>.job.<command>``) with a progress display, the record printed with
    ``tables.print_<command>``, and exit 1 when a target failed (compare) or did not pass (parity)."""
    import importlib

    from . import tables
    from .progress import target_progress

    job = importlib.import_module(f"xbridge.{command}.job")
    options = getattr(job, f"{command.capitalize()}Options")(targets=_target_list(fields.pop("backends")), **fields)
    prog = _load(program_path, options.precision, mesh=options.mesh, rng=options.rng, remat=options.remat,
                 attention=options.attention)
    check_writable(out, "--out")
    with target_progress(enabled=format is Format.human, label=f"{command} {prog.name}") as tick:
        record = getattr(job, command)(program_path, prog, options, out, progress=tick)
    _emit(record, format, getattr(tables, f"print_{command}"))
    if not record.get("passed", all(row["status"] == "ok" for row in record["targets"])):
        raise typer.Exit(1)


def _emit(record: Any, format: Format, human: Any) -> None:
    if format is Format.json:
        print(json.dumps(record, indent=2))
    else:
        human(record)


@app.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
             epilog="Example: xbridge run programs/gpt.py --backend eager-cpu --steps 50 --out out/gpt\n\n"
             "Checkpoints: xbridge run programs/gpt.py --backend jax-cpu --steps 100 --checkpoint-every 20 "
             "--checkpoint-dir ckpt\n\n"
             "Resume: xbridge run programs/gpt.py --backend xla-cpu --steps 200 --resume ckpt --checkpoint-dir ckpt",
             cls=_WithBackendOptions)
def run(
    ctx: typer.Context,
    program: str = typer.Argument(..., help="Program file (defines `program = xb.Program(...)`), or FILE.py:NAME."),
    backend: str = typer.Option("eager", "--backend", "-b", help="Target BACKEND-DEVICE (e.g. eager-cpu, "
                                                                 "jax-tpu) or a bare backend name."),
    steps: int = typer.Option(30, help="Optimizer steps to run (warm-up included)."),
    warmup: int | None = typer.Option(None, help="Leading steps excluded from timing, where tracing and "
                                                 "compilation happen (default 2)."),
    seed: int | None = typer.Option(None, help="Override the program's seed (initial weights and batches)."),
    precision: str | None = typer.Option(None, help="Override the precision: fp32, bf16-mixed, bf16-true, "
                                                    "fp16-mixed or params=...,compute=...,output=..."),
    rng: str | None = RNG,
    remat: str | None = REMAT,
    attention: str | None = ATTENTION,
    devices: int = typer.Option(1, help="Devices the mesh spans (with --processes: devices per process)."),
    mesh: str | None = MESH,
    processes: str | None = PROCESSES,
    out: Path | None = typer.Option(None, help="Directory to write run.json into."),
    dump: Path | None = typer.Option(None, help="Directory to write what the backend compiled (graphs, HLO)."),
    save_state: Path | None = typer.Option(None, help="Write the final parameters and buffers (eager names) to "
                                                      "this .npz file."),
    init_state: Path | None = typer.Option(None, help="Start from these weights (.npz under the eager names) "
                                                      "instead of building them from the seed."),
    trace_modules: Path | None = typer.Option(None, help="Before training, write every module's output on batch "
                                                         "0 to this .npz (for parity --bisect)."),
    checkpoint_dir: Path | None = typer.Option(None, help="Write checkpoints here: at the end, every "
                                                          "--checkpoint-every steps and on Ctrl-C."),
    checkpoint_every: int | None = typer.Option(None, help="Save a checkpoint every N steps (needs --checkpoint-dir)."),
    keep: int | None = typer.Option(None, help="Newest checkpoints kept in --checkpoint-dir (default 3)."),
    resume: Path | None = typer.Option(None, help="Continue from a checkpoint (a step-NNNNNNNN directory, or a "
                                                  "checkpoint directory: its newest); --steps stays the total."),
    allow_config_change: bool = typer.Option(False, "--allow-config-change", help="Resume a checkpoint written "
                                                                                  "by another program config "
                                                                                  "(shapes must still match)."),
    prefetch: bool = typer.Option(True, "--prefetch/--no-prefetch", help="Load the next batch while the current "
                                                                         "step runs (docs/data.md)."),
    tensorboard: Path | None = TENSORBOARD,
    profile: str | None = PROFILE,
    matmul_dtypes: bool = typer.Option(False, "--matmul-dtypes", help="After the run, count the matrix products of "
                                                                      "one forward pass by the dtype they compute in "
                                                                      "(docs/parity.md)."),
    format: Format = typer.Option(Format.human, "--format", help="human: progress bar and table; json: one JSON "
                                                                 "document on stdout."),
) -> None:
    """Run a program on one target and report per-step loss and step time. Backend options (e.g. --sharding-mode)
    are listed at the end of this help."""
    from ..run import processes as job
    from ..run.loop import RunOptions
    from ..run.loop import run as run_program
    from .progress import progress_bar
    from .tables import print_run

    backend_options = _backend_options(ctx)
    spread = job.parse(processes)
    if spread != 1:
        from ..contract import registry

        job.joining()       # before the target is resolved: a jax accelerator probe would start the runtime
        try:
            target, chosen = registry.resolve(backend)
            if not chosen.multi_process:
                chosen.join_processes(target.device, devices, spread)      # the backend's own refusal
        except BaseException:
            job.joining(False)
            raise
    if keep is not None and checkpoint_dir is None:
        raise ConfigError("--keep needs --checkpoint-dir DIR (the checkpoints it keeps are written there)")
    if allow_config_change and resume is None:
        raise ConfigError("--allow-config-change needs --resume CHECKPOINT (it lets a resume take a checkpoint of "
                          "another program config)")
    options = RunOptions(steps=steps, warmup=warmup, devices=devices, dump=dump, state_out=save_state,
                         trace_out=trace_modules, backend_options=backend_options, checkpoint_dir=checkpoint_dir,
                         checkpoint_every=checkpoint_every, keep=3 if keep is None else keep, resume=resume,
                         allow_config_change=allow_config_change, prefetch=prefetch, matmul_dtypes=matmul_dtypes,
                         tensorboard=tensorboard, profile=profile,
                         profile_dir=out / "profile" if out is not None and profile is not None else None,
                         processes=spread)
    prog = _load(program, precision, seed, mesh, rng, remat, attention)
    weights = read_npz(init_state, "--init-state") if init_state is not None else None
    if out is not None:
        check_writable(out, "--out")
    if dump is not None:
        check_writable(dump, "--dump")
    if tensorboard is not None:
        check_writable(tensorboard, "--tensorboard")
    for path, flag in ((save_state, "--save-state"), (trace_modules, "--trace-modules")):
        if path is not None:
            check_file_writable(path, flag)
    if job.must_start(spread):       # checked above; now the processes, each running this same command
        assert isinstance(spread, int)
        raise typer.Exit(job.start(spread, _ARGV))
    from ..data.contract import tokens_per_example

    tokens = prog.data.batch_size * tokens_per_example(prog.data)
    lead = (job.environment_job() or (0, 1))[0] == 0       # process 0 shows the progress
    with progress_bar(enabled=format is Format.human and lead, total=steps, label=f"{prog.name} on {backend}",
                      tokens_per_step=tokens) as tick:
        result = run_program(prog, backend, options, progress=tick, weights=weights)
    if job.this_process()[0] > 0:        # the report and run.json are process 0's
        return
    if out is not None:
        result.written = str(out / "run.json")
        write_json(out / "run.json", result.to_json())
    if format is Format.json:
        print(json.dumps(result.to_json(), indent=2))
    else:
        print_run(result)


@app.command(epilog="Example: xbridge compare programs/gpt.py --backends eager-cpu,jax-cpu --steps 20 --out "
                    "out/compare")
def compare(
    program: str = PROGRAM,
    backends: str | None = typer.Option(
        None, "--backends", help="Comma-separated targets, each optionally TARGET:OPTION=VALUE to pass a run option "
        "(e.g. xla-cpu:xla-mode=openxla,jax-cpu:sharding-mode=shard_map). Default: every target available here; "
        "the reference (--reference) is always run."),
    steps: int = typer.Option(20, help="Steps per target (warm-up included)."),
    warmup: int | None = typer.Option(None, help="Leading steps excluded from timing (default 3, or steps - 1 when "
                                                 "fewer steps are run)."),
    devices: int = TARGET_DEVICES,
    processes: int = TARGET_PROCESSES,
    precision: str | None = typer.Option(None, help="Override the program's precision."),
    rng: str | None = RNG,
    remat: str | None = REMAT,
    attention: str | None = ATTENTION,
    mesh: str | None = MESH,
    timeout: float = TIMEOUT,
    reference: str = REFERENCE_OPTION,
    tensorboard: Path | None = TENSORBOARD,
    profile: str | None = PROFILE,
    out: Path = typer.Option(Path("out/compare"), help="Directory for results.json, results.csv, the plots and "
                                                       "each run's run.json."),
    format: Format = FORMAT,
) -> None:
    """Run the program on several targets, each in its own process, and compare them side by side."""
    warmup = min(3, steps - 1) if warmup is None else warmup
    if tensorboard is not None:
        check_writable(tensorboard, "--tensorboard")
        from ..run.scalars import check_available

        check_available()
    if profile is not None:
        from ..run.profile import ProfileSpec

        ProfileSpec.parse(profile, steps)
    _over_targets("compare", program, out, format, backends=backends, steps=steps, warmup=warmup, devices=devices,
                  precision=precision, mesh=mesh, timeout_s=timeout, reference=reference, rng=rng,
                  remat=remat, attention=attention, tensorboard=tensorboard, profile=profile, processes=processes)


@app.command(epilog="Example: xbridge parity programs/mlp.py --backends jax-cpu,xla-cpu --devices 4 --mesh "
                    "data=-1,model=2 --bisect")
def parity(
    program: str = PROGRAM,
    backends: str | None = typer.Option(None, "--backends", help="Comma-separated targets to check, each "
                                                                 "optionally TARGET:OPTION=VALUE (e.g. "
                                                                 "xla-cpu:xla-mode=openxla). Default: every target "
                                                                 "available here."),
    steps: int = typer.Option(20, help="Steps to compare."),
    devices: int = TARGET_DEVICES,
    processes: int = TARGET_PROCESSES,
    precision: str | None = typer.Option(None, help="Override the precision (the reference runs it too; the "
                                                    "fp32 deviation is reported as well)."),
    rng: str | None = RNG,
    remat: str | None = REMAT,
    attention: str | None = ATTENTION,
    mesh: str | None = MESH,
    bisect: bool = typer.Option(False, "--bisect", help="Also name the first module whose forward output "
                                                        "deviates (hooks on every module, first batch)."),
    timeout: float = TIMEOUT,
    reference: str = REFERENCE_OPTION,
    jobs: int = typer.Option(1, "--jobs", help="Runs at a time, each its own process (parity compares results, "
                                               "not timings; mind the memory of N models)."),
    format: Format = FORMAT,
    out: Path = typer.Option(Path("out/parity"), help="Directory for parity.json, the initial weights and each "
                                                      "target's state."),
) -> None:
    """Check that every target matches the eager reference: same weights, same batches, the tolerance policy."""
    _over_targets("parity", program, out, format, backends=backends, steps=steps, devices=devices,
                  precision=precision, mesh=mesh, bisect=bisect, timeout_s=timeout, jobs=jobs,
                  reference=reference, rng=rng, remat=remat, attention=attention, processes=processes)


@app.command(epilog="Example: xbridge cache --clear inductor")
def cache(
    names: list[str] = typer.Argument(None, help="With --clear: the caches to empty (default: all).",
                                      show_default=False),
    clear: bool = typer.Option(False, "--clear", help="Empty the caches (the next run of each backend compiles "
                                                      "from scratch)."),
    format: Format = FORMAT,
) -> None:
    """Where the compilation caches are and how big they are; --clear empties them."""
    from .. import cache as caches
    from .tables import print_caches

    if names and not clear:
        raise ConfigError("cache names are for --clear (xbridge cache --clear inductor); `xbridge cache` lists them")
    removed = caches.clear(list(names or [])) if clear else None
    rows = [dataclasses.asdict(info) for info in (removed if removed is not None else caches.describe())]
    record = {"root": str(caches.cache_root()), "cleared": clear, "caches": rows}
    _emit(record, format, print_caches)


@app.command(epilog="Example: xbridge backends --format json")
def backends(format: Format = FORMAT) -> None:
    """List every known target: available here, or the reason it is not; versions and device counts."""
    from ..contract.registry import describe
    from .tables import print_backends

    rows = describe()
    _emit(rows, format, print_backends)


@app.command(epilog="Example: xbridge inspect programs/gpt.py --devices 8 --mesh data=-1,model=2")
def inspect(
    program: str = PROGRAM,
    devices: int = typer.Option(1, help="Devices the mesh spans."),
    mesh: str | None = MESH,
    precision: str | None = typer.Option(None, help="Override the precision (changes parameter bytes)."),
    remat: str | None = REMAT,
    format: Format = FORMAT,
) -> None:
    """Print parameter count, FLOPs per step, the sharding plan and the memory per device (parameters, gradients,
    optimizer state, activations), without running anything."""
    from ..compare.flops import flops_per_step
    from ..data.contract import checked_batch
    from ..memory import estimate
    from ..planner import plan
    from .tables import print_inspect

    prog = _load(program, precision, mesh=mesh, remat=remat)
    the_plan = plan(prog, devices)
    batch = checked_batch(prog.data, 0, prog.seed)
    info = {"program": prog.name, "config_hash": prog.config_hash, "precision": prog.precision.name,
            "flops_per_step": flops_per_step(prog, batch), "batch_size": prog.data.batch_size,
            "plan": the_plan.to_json(), "memory": estimate(prog, the_plan, batch).to_json()}
    _emit(info, format, print_inspect)


_RESOURCE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.ENOMEM, errno.EROFS}


def _resource_error(exc: OSError) -> None:
    where = f" on {exc.filename!r}" if exc.filename else ""
    print(f"error: {exc.strerror}{where} (errno {exc.errno}); free the resource or choose another path "
          "(XBRIDGE_DEBUG=1 shows the traceback)", file=sys.stderr)
    sys.exit(1)


_ARGV: list[str] = []      # the command line main() was given: --processes starts its processes with it


def main(argv: list[str] | None = None) -> None:
    global _ARGV
    _ARGV = list(argv) if argv is not None else sys.argv[1:]
    debug = os.environ.get("XBRIDGE_DEBUG", "") not in ("", "0")
    try:
        code = app(args=argv, prog_name="xbridge", standalone_mode=False)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        print("error: interrupted", file=sys.stderr)
        sys.exit(130)
    except typer.TyperException as exc:  # usage errors: unknown option, missing argument, bad value
        ctx = getattr(exc, "ctx", None)
        command = ctx.command_path if ctx is not None else "xbridge"
        message = exc.format_message() if hasattr(exc, "format_message") else str(exc)
        if type(exc).__name__ == "NoArgsIsHelpError":
            print(message, file=sys.stderr)
        else:
            print(f"error: {message} (see `{command} --help`)", file=sys.stderr)
        sys.exit(getattr(exc, "exit_code", 2))
    except XBridgeError as exc:
        if debug:
            raise
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)
    except Exception as exc:
        if debug:
            raise
        from ..run.processes import after_lost_peer

        after_lost_peer(exc)        # a peer process died: its supervisor names it, not this echo of it
        if isinstance(exc, MemoryError):   # the environment: exit 1, the resource named
            print("error: out of host memory (MemoryError); use a smaller model or batch, fewer --jobs, or a machine "
                  "with more memory", file=sys.stderr)
            sys.exit(1)
        if isinstance(exc, OSError) and exc.errno in _RESOURCE_ERRNOS:    # disk full, quota, I/O: wherever raised
            _resource_error(exc)
        from ..program_file import user_frame

        found = user_frame(exc)
        if found is not None:      # the user's program raised (its model, loss or data): bad input, exit 2
            where, role = found
            message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            print(f"error: {type(exc).__name__}{': ' + message if message else ''} raised in the program's {role} at "
                  f"{where.filename}:{where.lineno} (in {where.name}); XBRIDGE_DEBUG=1 shows the traceback",
                  file=sys.stderr)
            sys.exit(2)
        if isinstance(exc, OSError) and exc.strerror:
            _resource_error(exc)
        print(f"error: {type(exc).__name__}: {exc} (XBRIDGE_DEBUG=1 shows the traceback)", file=sys.stderr)
        sys.exit(1)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
