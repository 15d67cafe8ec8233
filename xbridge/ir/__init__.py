"""The IR: what a user writes, as plain frozen dataclasses that import no ML framework.

``program`` (Program, StepOptions), ``data`` (data specs), ``optim`` (optimizers and schedules), ``precision``,
``mesh``, ``sharding``, and ``serialize`` (the JSON form and the config hash). Every non-callable field serialises.
"""

from __future__ import annotations

from . import data, sharding
from .mesh import Mesh, parse_mesh
from .optim import SGD, AdamW, Constant, WarmupCosine
from .precision import Precision, parse_precision
from .program import Program, StepOptions
from .sharding import Sharding

__all__ = ["AdamW", "Constant", "Mesh", "Precision", "Program", "SGD", "Sharding", "StepOptions", "WarmupCosine",
           "data", "parse_mesh", "parse_precision", "sharding"]
