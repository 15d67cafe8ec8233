"""Precision policy: the dtype parameters are stored in, the dtype compute runs in, and the dtype of the model's
output that the loss sees. Names follow the ecosystem (Lightning/MaxText)."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from .serialize import register

# The floating dtypes a precision may name, with their size in bytes: the one dtype table of the project.
# Backends map a name to their own dtype object by name (getattr(torch, name), jnp.dtype(name)).
DTYPES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}
_ALIASES = {"fp32": "float32", "f32": "float32", "bf16": "bfloat16", "fp16": "float16", "f16": "float16",
            "half": "float16", "float": "float32"}
LOSS_SCALES = ("none", "dynamic")


@register
@dataclass(frozen=True)
class Precision:
    """``params``: storage dtype of parameters (and optimizer math); ``compute``: dtype of matmuls/activations;
    ``output``: dtype the model's output is cast to before the loss (the loss and its reductions always run in
    float32); ``loss_scale``: ``"dynamic"`` (fp16) or ``"none"``."""

    params: str = "float32"
    compute: str = "float32"
    output: str = "float32"
    loss_scale: str = "none"

    def __post_init__(self) -> None:
        for field in ("params", "compute", "output"):
            value = _ALIASES.get(getattr(self, field), getattr(self, field))
            if value not in DTYPES:
                raise ConfigError(f"precision {field}={getattr(self, field)!r} is not a dtype; use one of "
                                  f"{', '.join(DTYPES)}")
            object.__setattr__(self, field, value)
        if self.loss_scale not in LOSS_SCALES:
            raise ConfigError(f"precision loss_scale={self.loss_scale!r} is invalid; use one of "
                              f"{', '.join(LOSS_SCALES)}")
        if self.loss_scale == "dynamic" and "float16" not in (self.compute, self.params):
            raise ConfigError("precision loss_scale='dynamic' only applies when compute or params is float16")

    @property
    def name(self) -> str:
        for name, policy in NAMED.items():
            if policy == self:
                return name
        return f"params={self.params},compute={self.compute},output={self.output}" + (
            f",loss_scale={self.loss_scale}" if self.loss_scale != "none" else "")

    @property
    def mixed(self) -> bool:
        return self.compute != self.params


NAMED: dict[str, Precision] = {
    "fp32": Precision("float32", "float32", "float32"),
    "bf16-mixed": Precision("float32", "bfloat16", "float32"),
    "bf16-true": Precision("bfloat16", "bfloat16", "float32"),
    "fp16-mixed": Precision("float32", "float16", "float32", loss_scale="dynamic"),
}


def parse_precision(value: str | Precision) -> Precision:
    """Accept a :class:`Precision`, a name (``fp32``, ``bf16-mixed``, ``bf16-true``, ``fp16-mixed``) or the string
    form ``params=float32,compute=bfloat16,output=float32[,loss_scale=dynamic]``."""
    if isinstance(value, Precision):
        return value
    if not isinstance(value, str):
        raise ConfigError(f"precision must be a name or xb.Precision, not {type(value).__name__}")
    text = value.strip()
    if text in NAMED:
        return NAMED[text]
    if "=" not in text:
        raise ConfigError(f"unknown precision {value!r}; use one of {', '.join(NAMED)} or "
                          "'params=float32,compute=bfloat16,output=float32'")
    fields: dict[str, str] = {}
    for part in text.split(","):
        key, sep, val = part.partition("=")
        key, val = key.strip(), val.strip()
        if not sep or key not in ("params", "compute", "output", "loss_scale"):
            raise ConfigError(f"bad precision part {part.strip()!r} in {value!r}; expected keys params, compute, "
                              "output, loss_scale")
        if key in fields:
            raise ConfigError(f"precision key {key!r} given twice in {value!r}")
        fields[key] = val
    missing = {"params", "compute"} - fields.keys()
    if missing:
        raise ConfigError(f"precision {value!r} lacks {', '.join(sorted(missing))}")
    compute = _ALIASES.get(fields["compute"], fields["compute"])
    fields.setdefault("output", "float32")
    fields.setdefault("loss_scale", "dynamic" if compute == "float16" else "none")
    return Precision(**fields)
