"""What ``xbridge check`` produces, typed: a :class:`CheckRecord` with one :class:`TargetCheck` per target (its
verdict and findings); ``--format json`` is its :meth:`CheckRecord.to_json`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ..contract.checks import Finding


@dataclass
class TargetCheck:
    target: str
    verdict: str                    # runs, runs-slow, differs, fails
    summary: str                    # one line: the verdict and its first reason, with what to change
    operators: dict[str, int]       # operator_support's answer -> how many of the step's operators
    findings: list[Finding] = field(default_factory=list)


@dataclass
class CheckRecord:
    program: str
    config_hash: str
    precision: str
    devices: int
    mesh: dict[str, int]
    rng: str
    traced_on: str                  # meta, or cpu when the meta device could not run the step
    meta_failure: str | None        # why not on the meta device
    operators: list[dict[str, Any]]     # every aten operator of the step: name, forward/backward counts, where
    functions: list[dict[str, str]]     # the user's autograd.Function classes
    draws: list[dict[str, Any]]         # random draws: module, op, portable
    mutated_inputs: list[str]
    memory: dict[str, Any]          # bytes per device (xbridge inspect's estimate)
    unmatched: list[str]            # parameters no sharding rule matches (replicated)
    targets: list[TargetCheck]

    def to_json(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data["targets"] = [dataclasses.asdict(t) for t in self.targets]
        return data
