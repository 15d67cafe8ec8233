"""What :meth:`Backend.lower` returns: a program lowered for one target, as the run loop drives it. The core contract
is these ten methods; everything else a backend can do is a capability (xbridge/contract/capabilities.py), which the
core asks for by type through :meth:`Executable.capability`: the executable itself where it subclasses the
capability's class, or a collaborator of its own that does."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from ..errors import LoweringError


@dataclass
class CompileCache:
    """What a run's compilations found in the backend's persistent caches, and the compile phases it timed."""

    hits: int
    misses: int
    caches: str                                 # which caches, in the backend's words
    seconds: dict[str, float] = field(default_factory=dict)   # compile phases as the backend times them
    compiles: dict[str, int] = field(default_factory=dict)    # compilations by program, where the backend counts
                                                              # them ("train step": 1 is one graph for every step)

    @property
    def state(self) -> str:
        """warm: every lookup hit; cold: every lookup missed; partial: both; unused: no lookup."""
        if self.hits and not self.misses:
            return "warm"
        if self.misses and not self.hits:
            return "cold"
        return "partial" if self.hits else "unused"

    def to_json(self) -> dict[str, Any]:
        return {"hits": self.hits, "misses": self.misses, "state": self.state, "caches": self.caches,
                "seconds": self.seconds, "compiles": self.compiles}

C = TypeVar("C")


def on_host(batch: Any) -> bool:
    """Whether ``batch`` is still the host's numpy arrays (not yet :meth:`Executable.put`)."""
    return isinstance(batch, dict) and any(isinstance(v, np.ndarray) for v in batch.values())


class Executable(ABC):
    """A program lowered for one target. Arrays cross the boundary as numpy, under the eager parameter names."""

    parts: tuple[Any, ...] = ()     # collaborators that hold capabilities for it (see :meth:`capability`)

    @abstractmethod
    def init(self, weights: dict[str, np.ndarray]) -> None:
        """Load the initial weights (float32 numpy, eager names) and create the optimizer state."""

    @abstractmethod
    def step(self, batch: Any) -> dict[str, float]:
        """Run one optimizer step on the global batch (numpy, or what :meth:`put` made of it); return metrics (at
        least ``loss``) once the device is done."""

    def fetch(self, source: Any, step: int, seed: int, check: Callable[[Any, int], dict[str, np.ndarray]]) -> Any:
        """Step ``step``'s batch for :meth:`step`: read from the data ``source``, ``check``-ed, :meth:`put`. The run
        loop calls it one step ahead on its prefetch thread. A backend whose processes each read only their own
        rows overrides it (the distributed inductor ranks)."""
        return self.put(check(source.batch(step, seed), step))

    def put(self, batch: dict[str, np.ndarray]) -> Any:
        """The batch moved where :meth:`step` and :meth:`evaluate` read it (the device, sharded as planned). The run
        loop calls it on its prefetch thread, one step ahead, so the transfer overlaps the running step."""
        return batch

    def evaluate(self, batch: Any) -> float:
        """The loss of one batch with the model in eval mode, no gradient and no update (``xb.Eval``)."""
        raise LoweringError(f"{type(self).__name__} cannot evaluate (the program's xb.Eval)")

    def capability(self, kind: type[C]) -> C | None:
        """What this executable has of the capability ``kind`` (a class of xbridge/contract/capabilities.py): itself
        where it subclasses ``kind``, else the first of its :attr:`parts` that does (a collaborator holding what the
        capability needs), else None."""
        for holder in (self, *self.parts):
            if isinstance(holder, kind):
                return holder
        return None

    def close(self) -> None:
        """The run is over: undo what lowering changed in the process's global state (torch's TF32 switches) and let
        go of what the executable started (other ranks). The run loop calls it once, last."""
        return None

    @abstractmethod
    def state_dict(self) -> dict[str, np.ndarray]:
        """Current parameters and buffers as full (unsharded) numpy arrays under the eager names."""

    @abstractmethod
    def training_state(self) -> dict[str, np.ndarray]:
        """Everything but the weights that the next step depends on, full numpy arrays under backend-neutral
        names (``optim/<param>/<torch.optim key>``, ``loop/updates``, ``scaler/*``, ``rng/*``; see
        xbridge/checkpoint/format.py). Written into checkpoints; read back by any backend."""

    @abstractmethod
    def load_training_state(self, state: dict[str, np.ndarray]) -> None:
        """After :meth:`init`: continue from ``state`` (from :meth:`training_state` of any backend), sharding it
        like the parameters it belongs to."""
