"""What ``xbridge check`` asks a backend about a program's training step before anything runs: an optional capability
of a :class:`~xbridge.contract.Backend` (like :class:`~xbridge.contract.ahead_of_time.AheadOfTime`), answered from the
stack's own tables (torchax's operator registry, torch_xla's kernels at the dispatcher, Inductor's lowerings) and
its known behaviour, never by compiling.

The core traces the step once (xbridge/torch/op_census.py: every aten operator of the forward and backward, the
user's autograd Functions, random draws, host reads, data-dependent shapes) and hands the census to each target's
backend; the findings that hold for every stack (random draws, sharding, memory) are the core's own
(xbridge/check/)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..ir.program import Program
    from ..torch.op_census import Census

# Worst first: a finding's severity decides the target's verdict (xbridge/check/job.py).
SEVERITIES = ("fails", "differs", "slow", "note")

# operator_support's answers, and the severity of each (None: nothing to report)
OPERATOR_SEVERITY = {"lowered": None, "decomposed": None, "kernel": "note", "host": "slow", "missing": "fails"}


@dataclass
class Finding:
    """One thing about the step on one target: how bad (:data:`SEVERITIES`), what (an operator, a construct),
    where (module and the program's file:line) and why, with what to change."""

    severity: str
    what: str
    where: str
    why: str
    operator: bool = False      # about one operator's kernel (not a construct): as the device traced on saw it


class StepChecks(ABC):
    """A backend that can say, from its stack's tables, how it will carry a traced step."""

    @abstractmethod
    def operator_support(self, census: Census) -> dict[str, str]:
        """Each aten operator of the census (``aten::addmm``, ``aten::sum.dim_IntList``; its ``ops``, with the
        forward and backward calls of each) -> ``lowered`` (the stack computes it itself, or never calls it: a stack
        that differentiates the forward itself has no use for torch's backward operators), ``decomposed`` (into
        operators it computes), ``kernel`` (torch's own kernel, called from the compiled code), ``host`` (copied to
        the host and back at every call) or ``missing`` (the step fails)."""

    def construct_findings(self, census: Census, program: Program, options: dict[str, str]) -> list[Finding]:
        """What the stack does with the step's constructs: reads of a value on the host, data-dependent shapes, a
        user's autograd Functions, for ``program`` (its precision, its step options) under the backend's
        ``options`` (defaults filled in: ``resolve_options``).
        Default: nothing to say. A ``fails`` finding is one the stack is known to fail on: ``xbridge run`` (and so
        ``parity``) refuses the program with it before anything is compiled."""
        return []
