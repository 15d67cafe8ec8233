"""The same target on two framework versions in one compare (``inductor-cpu`` beside ``inductor-cpu@xla``, each
environment its own torch): parity between the two rows and their speed ratio, the question every framework upgrade
asks, answered from the rows the compare already has. Also what each row ran on (its frameworks' versions)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..environments import locate, stack_text
from ..parity import policy
from .record import CompareRow

FRAMEWORKS = ("torch", "torch_xla", "jax", "jaxlib", "torchax", "optax")


def frameworks(row: CompareRow) -> dict[str, str]:
    """The framework versions row's run ran on (its run record's, from its own interpreter)."""
    versions = row.result.versions if row.result is not None else {}
    return {name: versions[name] for name in FRAMEWORKS if name in versions}


def frameworks_text(row: CompareRow) -> str:
    return stack_text(row.result.versions if row.result is not None else None)


@dataclass
class VersionPair:
    """``other`` is ``baseline``'s target in another environment: what differs, and what it does."""

    target: str                     # the target both rows run (without @ENV or options)
    baseline: str                   # row labels, as the compare lists them
    other: str
    changed: dict[str, list[str]]   # framework -> [baseline's version, other's] (the versions that differ)
    step_ratio: float               # other's median step time / baseline's (above 1: other is slower)
    compile_ratio: float | None     # the same for compile time (None when baseline compiled nothing)
    max_loss_dev: float             # the largest |loss difference| relative to baseline's loss, over the steps
    max_loss_dev_at: str
    loss_limit: float               # the precision's parity tolerance
    matches: bool

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> VersionPair:
        return cls(**data)


def interpreters(targets: list[str]) -> dict[str, str]:
    """Where each target (``TARGET[@ENV][:OPTION=VALUE]``) runs: ``here`` or its environment's name. Two
    environments may hold different torch, transformers or timm versions, and each initialises a program's weights
    its own way: a compare whose targets span environments hands them one set of initial weights
    (:func:`xbridge.compare.job.compare`)."""
    found = {}
    for entry in targets:
        env = locate(entry.split(":")[0]).env
        found[entry] = "here" if env is None else env.name
    return found


def _base(label: str) -> str:
    return label.split(":")[0].split("@")[0]


def version_pairs(rows: list[CompareRow], tolerance: policy.Tolerance) -> list[VersionPair]:
    """Each finished row whose target (without environment, same options) appeared finished before it under
    another environment, paired with that first one."""
    first: dict[str, CompareRow] = {}
    pairs = []
    for row in rows:
        if row.status != "ok" or row.result is None or row.metrics is None:
            continue
        key = _base(row.target) + "".join(":" + p for p in row.target.split(":")[1:])
        baseline = first.setdefault(key, row)
        if baseline is row or baseline.target == row.target:
            continue
        assert baseline.result is not None and baseline.metrics is not None
        a, b = frameworks(baseline), frameworks(row)
        changed = {k: [a.get(k, "-"), b.get(k, "-")] for k in dict.fromkeys([*a, *b]) if a.get(k) != b.get(k)}
        dev = policy.loss_deviation(baseline.result.losses, row.result.losses, tolerance)
        pairs.append(VersionPair(
            target=_base(row.target), baseline=baseline.target, other=row.target, changed=changed,
            step_ratio=row.metrics.step_ms_median / baseline.metrics.step_ms_median,
            compile_ratio=(row.metrics.compile_s / baseline.metrics.compile_s
                           if baseline.metrics.compile_s > 0 else None),
            max_loss_dev=dev.value, max_loss_dev_at=dev.where, loss_limit=dev.limit, matches=dev.ok))
    return pairs


def describe(pair: VersionPair) -> str:
    """One line: what changed, the speed, the parity."""
    changed = ", ".join(f"{k} {a} -> {b}" for k, (a, b) in pair.changed.items()) or "the same framework versions"
    speed = (f"{pair.step_ratio:.2f}x the step time" if abs(pair.step_ratio - 1) >= 0.005 else "the same step time")
    compiled = f", {pair.compile_ratio:.2f}x the compile time" if pair.compile_ratio is not None else ""
    verdict = "match" if pair.matches else "DIFFER"
    return (f"{pair.other} against {pair.baseline} ({changed}): {speed}{compiled}; losses {verdict} "
            f"(max deviation {pair.max_loss_dev:.1e} at {pair.max_loss_dev_at}, limit {pair.loss_limit:.0e})")
