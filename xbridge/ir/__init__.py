"""The IR: what a user writes, as plain frozen dataclasses that import no ML framework.

``program`` (Program, StepOptions), ``optim`` (optimizers and schedules), ``precision``,
``mesh``, ``sharding``, and ``serialize`` (the JSON form and the config hash). Every non-callable field serialises.
"""

from __future__ import annotations

from . import sharding
from .loss import LossSum
from .mesh import Mesh, parse_mesh
from .optim import SGD, AdamW, Constant, WarmupCosine
from .precision import Precision, parse_precision
from .program import Eval, Program, StepOptions
from .sharding import Sharding

__all__ = ["AdamW", "Constant", "Eval", "LossSum", "Mesh", "Precision", "Program", "SGD", "Sharding", "StepOptions",
           "WarmupCosine", "parse_mesh", "parse_precision", "sharding"]
