"""What a forward reads from the host's Python state, found before compute (``xbridge check``, and ``xbridge run``
before it compiles): draws from numpy's or Python's global random generator, and values that change from one call
of the loss to the next (a global a data source sets, a counter the loss keeps).

A stack that runs the program's Python at every step (eager, torch_xla's lazy tensors) computes with each step's
value. JAX traces the step once: whatever Python value the trace saw is a constant of the compiled step, the same
at every step, and the run trains another program without a word. Both are found the way the issue that asked for
them suggested:

- the generators' states are compared around one forward (``np.random.get_state()``, ``random.getstate()``); a
  forward that moved one is run again under :func:`sys.settrace` to find the program's line that drew;
- the forward runs again on the same batch, twice (the first run may build what later ones reuse, a cached table),
  then once after the data source read batch 1 (as a run would), and the Python numbers the operators receive (the
  ``0.5`` of ``x * 0.5``, a shape, a dim) are compared call by call: the first that differs names the operator and
  the program's line.

torch's own generator is not host state: ``torch.rand`` is a random draw every stack carries (``--rng``)."""

from __future__ import annotations

import random
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

__all__ = ["Signature", "describe_difference", "first_difference", "generator_states", "generators_moved",
           "locate_draw", "restore_states", "scalars_of"]

_NUMBERS = (bool, int, float, complex)


def scalars_of(args: Any, kwargs: Any, on_meta: bool) -> tuple:
    """The Python numbers an operator call receives (flattened), and on the meta device the values of the CPU
    0-d tensors among its arguments (``x * 0.5`` wraps 0.5 as one): what a trace bakes into a compiled step."""
    found: list[Any] = []

    def visit(value: Any) -> None:
        if isinstance(value, _NUMBERS):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            for item in value:
                visit(item)
        elif on_meta and isinstance(value, torch.Tensor) and value.device.type == "cpu" and value.dim() == 0:
            found.append(value.item())

    visit(args)
    visit(list((kwargs or {}).values()))
    return tuple(found)


Signature = list[tuple[str, tuple]]      # per forward operator call: its name and the Python numbers it received


def first_difference(first: Signature, second: Signature) -> int | None:
    """The index of the first operator call that differs between two forwards (name or numbers), None when none;
    a forward that calls fewer operators the second time differs where it stops."""
    for index, (a, b) in enumerate(zip(first, second, strict=False)):
        if a[0] != b[0] or not _same(a[1], b[1]):
            return index
    return None if len(first) == len(second) else min(len(first), len(second))


def _same(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and all(x == y or (x != x and y != y) for x, y in zip(a, b, strict=True))  # NaN == NaN


def describe_difference(first: Signature, second: Signature, index: int) -> str:
    if index >= min(len(first), len(second)):
        return "a forward that calls other operators from call to call"
    (name_a, a), (name_b, b) = first[index], second[index]
    if name_a != name_b:
        return f"a forward that calls other operators from call to call ({name_a}, then {name_b})"
    changed = [(x, y) for x, y in zip(a, b, strict=False) if not _same((x,), (y,))] or [(a, b)]
    return f"a Python value that changes from call to call ({changed[0][0]!r}, then {changed[0][1]!r}, in {name_a})"


def generator_states() -> tuple[Any, Any]:
    return np.random.get_state(), random.getstate()      # numpy's: (name, keys, position, has_gauss, gauss)


def restore_states(states: tuple[Any, Any]) -> None:
    """Put numpy's and Python's global generators back to ``states`` (:func:`generator_states`)."""
    np.random.set_state(states[0])
    random.setstate(states[1])


def generators_moved(before: tuple[Any, Any]) -> list[str]:
    """Which global host generators moved since ``before`` (:func:`generator_states`)."""
    now = generator_states()
    moved = []
    if not _same_state(before[0], now[0]):
        moved.append("numpy's global generator (np.random)")
    if before[1] != now[1]:
        moved.append("Python's global generator (random)")
    return moved


def _same_state(a: tuple, b: tuple) -> bool:
    return bool(np.array_equal(a[1], b[1])) and a[0] == b[0] and a[2:] == b[2:]


def locate_draw(run: Callable[[], Any], is_user: Callable[[str], bool]) -> dict[str, str]:
    """Run ``run`` (one forward) under :func:`sys.settrace`, the lines of every frame whose file ``is_user`` (not
    torch's, xbridge's or the standard library's) traced; per generator that drew, ``file:line`` of the first
    line it moved on (a draw in numpy's compiled code, or in a library, shows in the program's line that called
    it)."""
    state = [generator_states()]
    lines: dict[str, str] = {}
    last: dict[Any, int] = {}

    def local(frame: Any, event: str, arg: Any) -> Any:
        moved = generators_moved(state[0])
        if moved:
            where = f"{frame.f_code.co_filename}:{last.get(frame, frame.f_lineno)}"
            for what in moved:
                lines.setdefault(what, where)
            state[0] = generator_states()
        last[frame] = frame.f_lineno
        return local

    def calls(frame: Any, event: str, arg: Any) -> Any:
        return local if event == "call" and is_user(frame.f_code.co_filename) else None

    previous = sys.gettrace()
    sys.settrace(calls)
    try:
        run()
    finally:
        sys.settrace(previous)
    return lines
