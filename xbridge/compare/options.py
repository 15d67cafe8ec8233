"""What ``xbridge compare`` is asked for (:class:`CompareOptions`): checked when made, passed on to every target's
``xbridge run`` (:meth:`CompareOptions.child`), and kept in the comparison record (``results.json``'s ``options``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..run.isolated import REFERENCE, ChildOptions


@dataclass
class CompareOptions:
    targets: list[str] | None = None     # None: every target available here
    steps: int = 20
    warmup: int = 3
    devices: int = 1
    precision: str | None = None
    mesh: str | None = None
    timeout_s: float = 900.0
    reference: str = REFERENCE   # the eager target the loss parity column is taken against (eager-cuda on a GPU)
    rng: str | None = None       # --rng: native or portable (None: the program's own)
    remat: str | None = None     # --remat: none, full or dots (None: the program's own)
    attention: str | None = None  # --attention: the attention kernel forced (None: the program's own)
    tensorboard: Path | None = None   # --tensorboard DIR: each target's scalars under DIR/<target>
    profile: str | None = None        # --profile steps=A:B: each target's trace under runs/<target>/profile
    processes: int = 1                # --processes: jax targets as this many processes of ``devices`` each
    topology: str | None = None       # --topology: targets not here (jax-tpu) compiled for this TPU slice instead
    recommend: bool = True            # --recommend/--no-recommend: name the target to run after the race

    def __post_init__(self) -> None:
        if self.processes < 1:
            raise ConfigError(f"--processes must be >= 1, got {self.processes}")
        if self.steps < 2 or not 0 < self.warmup < self.steps:
            raise ConfigError(f"compare needs --steps >= 2 and 0 < --warmup < --steps, got {self.steps} and "
                              f"{self.warmup}")
        if self.topology is not None:
            from ..aot.topology import parse_topology

            parse_topology(self.topology)       # a bad name: one line before anything runs
        if self.timeout_s <= 0:
            raise ConfigError(f"--timeout must be > 0 seconds, got {self.timeout_s}")

    def child(self) -> ChildOptions:
        return ChildOptions(self.steps, self.warmup, self.devices, self.precision, self.mesh, self.timeout_s,
                            rng=self.rng, remat=self.remat, attention=self.attention, tensorboard=self.tensorboard,
                            extra=["--profile", self.profile] if self.profile else [], processes=self.processes)

    def to_json(self) -> dict[str, Any]:
        """Every field, paths as text."""
        return {k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(self).items()}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CompareOptions:
        values = {f.name: data[f.name] for f in dataclasses.fields(cls) if f.name in data}
        if values.get("tensorboard") is not None:
            values["tensorboard"] = Path(values["tensorboard"])
        return cls(**values)
