"""``xbridge check PROG``: the program's step traced once by torch (xbridge/torch/op_census.py), then per target what
its backend says of each operator and construct (:class:`~xbridge.contract.checks.StepChecks`), with the findings
that hold on every stack: random draws against ``--rng``, parameters no sharding rule matches, and the memory per
device. Nothing is compiled or trained; the verdict per target is its worst finding."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..contract import Backend, registry
from ..contract.checks import OPERATOR_SEVERITY, SEVERITIES, Finding, StepChecks
from ..errors import ConfigError
from ..ir.program import Program
from .record import CheckRecord, TargetCheck

if TYPE_CHECKING:
    from ..torch.op_census import Census

VERDICTS = {"fails": "fails", "differs": "differs", "slow": "runs-slow", "note": "runs", None: "runs"}
_OPERATOR_WHY = {
    "missing": "{target} has no lowering or decomposition for it: the step fails there; rewrite that part with "
               "other operators or run it on another target",
    "host": "{target} has no kernel for it: its inputs go to the host, torch's CPU kernel runs, the result comes "
            "back, at every call",
    "kernel": "{target} calls torch's own kernel for it from the compiled code (no fusion across it)",
}


@dataclass
class CheckOptions:
    targets: list[str] | None = None    # None: every target available here or in an environment
    devices: int = 1


def default_targets() -> list[str]:
    return [row["target"] for row in registry.describe() if row["available"]]      # here (the CLI adds elsewhere)


def _backend(target: str) -> tuple[str, Backend | str]:
    """The canonical target and its backend, or why there is none. A target this machine cannot run (jax-tpu on a
    CPU) is still checked: the stack's tables are the same; its packages must be installed."""
    parsed = registry.parse_target(target)
    if isinstance(parsed, str):
        raise ConfigError(f"--backends {target!r}: give BACKEND-DEVICE (e.g. jax-cpu, jax-tpu)")
    loaded = registry.load(parsed.backend)
    if loaded.backend is None:
        return str(parsed), str(loaded.error)
    missing = loaded.backend.missing_package()
    if missing:
        return str(parsed), f"package {missing!r} is not installed (pip install 'xbridge[{loaded.backend.extra}]')"
    return str(parsed), loaded.backend


# Host state a forward reads (xbridge/torch/host_state.py), on a stack that runs the forward's Python at every step:
# severity, why
_HOST_READ = {
    "draw": ("note", "drawn at every step from the host's global generator, which xbridge seeds before step 0: the "
                     "numbers eager draws, unless other code draws from it meanwhile (a data source using it in the "
                     "thread that loads the next batch); torch.rand under --rng portable is the same on every stack"),
    "data": ("differs", "batches are loaded a step ahead, in a thread, so which step's value a forward sees depends "
                        "on the stack's timing and parity fails; pass the value in the batch"),
}


def _common(program: Program, backend_name: str, draws: list[dict], reads: list[dict], stack: list[Finding],
            ) -> list[Finding]:
    """Findings every stack shares: random draws under --rng, host state the forward reads (what the stack has
    not said already: JAX refuses it)."""
    said = {f.what for f in stack}
    found = [Finding(_HOST_READ[read["kind"]][0], read["what"], read["where"] or "(forward)",
                     _HOST_READ[read["kind"]][1])
             for read in reads if read["kind"] in _HOST_READ and backend_name != "eager" and read["what"] not in said]
    for draw in draws:
        what, where = f"random draw {draw['op']}", draw["module"]
        if program.step.rng == "portable" and not draw["portable"]:
            found.append(Finding("fails", what, where, "--rng portable refuses it (no portable sampler); run with "
                                 "--rng native, or replace it"))
        elif program.step.rng == "native" and backend_name != "eager":
            found.append(Finding("differs", what, where, f"draws from {backend_name}'s own generator, so its "
                                 "numbers differ from eager's and parity fails; --rng portable draws the same bits "
                                 "on every stack"))
    return found


def target_findings(program: Program, target: str, backend: Backend, found: Census,
                    options: dict[str, str]) -> tuple[list[Finding], dict[str, int]]:
    """Every finding for ``target`` (its ``backend`` and the backend's resolved ``options``), worst first: the
    stack's answer for each operator and construct (:class:`StepChecks`), then what holds on every stack; and how
    many operators got each answer."""
    backend_name = target.rpartition("-")[0]
    findings: list[Finding] = []
    counts: dict[str, int] = {}
    if isinstance(backend, StepChecks):
        support = backend.operator_support(found)
        replaced = found.replaced(program.step.rng)
        support = {name: status for name, status in support.items() if name not in replaced}
        counts = dict(Counter(support.values()))
        for name, status in support.items():
            severity = OPERATOR_SEVERITY[status]
            if severity is not None:
                findings.append(Finding(severity, name, found.ops[name].at,
                                        _OPERATOR_WHY[status].format(target=target), operator=True))
        findings += backend.construct_findings(found, program, options)
    else:
        findings.append(Finding("note", "operators", "-", f"backend {backend_name!r} does not say how it carries "
                                "operators (no StepChecks)"))
    findings += _common(program, backend_name, found.draws, found.host_reads, findings)
    return sorted(findings, key=lambda f: SEVERITIES.index(f.severity)), counts


def _verdict(target: str, findings: list[Finding]) -> tuple[str, str]:
    worst = min((f.severity for f in findings), key=SEVERITIES.index, default=None)
    verdict = VERDICTS[worst]
    if worst in (None, "note"):
        return verdict, "runs"
    first = next(f for f in findings if f.severity == worst)
    count = sum(f.severity == worst for f in findings)
    more = f" (and {count - 1} more)" if count > 1 else ""
    label = {"fails": "will not run", "differs": "runs, differs from eager", "slow": "runs, with host round trips "
             "or graph breaks"}[worst]
    return verdict, f"{label}: {first.what} in {first.where}{more}: {first.why}"


def check(program: Program, options: CheckOptions) -> CheckRecord:
    from ..data.source import checked_batch
    from ..memory import estimate
    from ..planner import plan
    from ..torch.op_census import census

    targets = options.targets if options.targets is not None else default_targets()
    the_plan = plan(program, options.devices)
    batch = checked_batch(program.data, 0, program.seed)
    found = census(program, batch)
    rows = []
    for entry in targets:
        target, backend = _backend(entry)
        if isinstance(backend, str):
            rows.append(TargetCheck(target, "fails", f"will not run: {backend}", {}))
            continue
        findings, counts = target_findings(program, target, backend, found, backend.resolve_options({}, target))
        verdict, summary = _verdict(target, findings)
        rows.append(TargetCheck(target, verdict, summary, counts, findings))
    plan_json = the_plan.to_json()
    sharded = any(size > 1 for size in dict(the_plan.mesh).values())
    return CheckRecord(
        program=program.name, config_hash=program.config_hash, precision=program.precision.name,
        devices=options.devices, mesh=dict(the_plan.mesh), rng=program.step.rng, traced_on=found.device,
        meta_failure=found.meta_failure, operators=found.to_json()["ops"], functions=found.functions,
        draws=found.draws, mutated_inputs=found.mutated_inputs,
        memory=estimate(program, the_plan, batch).to_json(),
        unmatched=[p["name"] for p in plan_json["params"] if p["rule"] is None] if sharded else [],
        targets=rows)
