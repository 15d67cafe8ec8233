"""The program a command runs: loaded from its file, with the command line's overrides applied."""

from __future__ import annotations

import dataclasses
from typing import Any

from ..errors import ConfigError


def load_with_overrides(program_path: str, precision: str | None = None, seed: int | None = None,
                        mesh: str | None = None, rng: str | None = None, remat: str | None = None,
                        attention: str | None = None) -> Any:
    """The program at ``program_path`` with the command's overrides (--precision, --seed, --mesh, --rng, --remat,
    --attention), each checked."""
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
