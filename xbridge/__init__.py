"""xbridge: write a PyTorch training program once; run, match and race it on eager, Inductor, torch_xla and JAX.

Importing this package imports no ML framework: the IR, the plan and the registry are plain Python; torch is
imported when a model is built, and a backend's framework when that backend lowers a program.
"""

from __future__ import annotations

__version__ = "0.1.0"

from . import data
from .errors import BackendUnavailable, ConfigError, PlanError, ProgramError, RunError, TargetError, XBridgeError
from .hints import shard
from .ir import (
                     SGD,
                     AdamW,
                     Constant,
                     Eval,
                     LossSum,
                     Mesh,
                     Precision,
                     Program,
                     Sharding,
                     StepOptions,
                     WarmupCosine,
                     parse_precision,
                     sharding,
)
from .planner import ParamPlan, ShardingPlan, plan

__all__ = [
    "AdamW", "BackendUnavailable", "ConfigError", "Constant", "Eval", "LossSum", "Mesh", "ParamPlan", "PlanError",
    "Precision", "Program", "ProgramError", "RunError", "SGD", "Sharding", "ShardingPlan", "StepOptions", "TargetError",
    "WarmupCosine", "XBridgeError", "data", "parse_precision", "plan", "shard", "sharding",
]
