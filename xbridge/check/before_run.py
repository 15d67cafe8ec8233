"""``xbridge run`` asks ``check``'s question first, for its own target: a program with a construct its stack is known
to fail on (``fails``: a value read on the host inside a step JAX traces, a data-dependent shape in torch_xla's one
graph, an operator the stack has no lowering for, a random draw ``--rng portable`` cannot carry) is refused with one
line before anything is compiled. ``parity`` runs every target through ``run``, so it refuses the same way.

What check says only ``differs`` (a random draw under ``--rng native``: a valid run, with the stack's own numbers)
is not refused: parity says it before it runs (parity/job.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..contract import Backend, Target
from ..contract.checks import StepChecks
from ..errors import ProgramError
from ..ir.program import Program
from .job import target_findings

if TYPE_CHECKING:
    from ..torch.op_census import Census


def checked_step(program: Program, census: bool) -> tuple[int | None, Census | None]:
    """What a run checks of the step before it compiles anything, with the program's own code: the loss (on the
    meta device; raises when the program cannot train, xbridge/torch/loss_check.py), and when ``census``, the
    forward's operators and constructs (None when the step cannot be traced here: the run then reports what its
    stack says). Returns the forward's attention calls (check_loss) and the census. The forward alone is traced
    (a backward here would break a later torch_xla step in the same process): what fails is in the forward (a
    host read, a data-dependent shape, an operator JAX has no lowering for, a random draw); the backward's
    operators are at worst slow. prepare.py runs this in a forked child (xbridge/forked.py)."""
    from ..data.source import checked_batch
    from ..torch.loss_check import check_loss
    from ..torch.op_census import census as traced

    calls = check_loss(program)
    if not census:
        return calls, None
    try:
        return calls, traced(program, checked_batch(program.data, 0, program.seed), backward=False)
    except Exception:      # the user's code raises with real values too: the run's own first step says where
        return calls, None


def refuse_what_fails(program: Program, target: Target, backend: Backend, options: dict[str, str],
                      found: Census | None) -> None:
    """Raise :class:`ProgramError` (exit 2) naming the first ``fails`` finding of the census ``found`` for
    ``target``, its module and line, why and what to change; nothing when the backend cannot say (no
    :class:`StepChecks`) or there is no census (:func:`checked_step`)."""
    if not isinstance(backend, StepChecks) or found is None:
        return
    try:
        findings, _ = target_findings(program, str(target), backend, found, options)
    except Exception:
        return
    # Traced on the CPU (the meta device could not run it), torch picks CPU kernels for composite operators
    # (sdpa's _scaled_dot_product_flash_attention_for_cpu, LSTM's mkldnn_rnn_layer) that no stack receives: what
    # an operator's kernel decides is left to the stack; the constructs (host reads, shapes, draws) stand.
    failing = [f for f in findings if f.severity == "fails" and not (f.operator and found.device == "cpu")]
    if not failing:
        return
    first = failing[0]
    more = f" (and {len(failing) - 1} more: xbridge check lists them)" if len(failing) > 1 else ""
    raise ProgramError(f"program {program.name!r} cannot run on {target}: {first.what} in {first.where}{more}: "
                       f"{first.why}")
