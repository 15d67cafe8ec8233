"""What ``xbridge parity`` produces, typed: the job builds a :class:`ParityRecord`, one :class:`ParityRow` per
target (its verdict, and when it finished, the :class:`ParityCheck` against the reference); ``parity.json`` and
``xbridge parity --format json`` are its :meth:`ParityRecord.to_json`, read back with :meth:`ParityRecord.from_json`.
A section the run did not ask for (the matmul census, --bisect, the eval losses, the fp32 reference) is left out of
the JSON, as its flag or None says here."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from .policy import Tolerance


@dataclass
class DivergentModule:
    """--bisect: the first module whose forward output deviates, and by how much (relative L2)."""

    module: str
    deviation: float


@dataclass
class DivergentGradient:
    """--bisect: the first module, in backward order, whose own parameter's gradient at step 0 deviates, which
    parameter, and by how much (relative L2)."""

    module: str
    parameter: str
    deviation: float


@dataclass
class NoiseFloor:
    """fp32, a target beyond the policy's bounds: the reference's own noise (the reference again from initial
    weights one ulp apart: its largest loss and parameter deviations from itself), and whether the target is within
    policy.NOISE_FACTOR x that (its verdict is then pass: parity cannot tell it from the reference)."""

    within: bool
    loss: float
    loss_at: str            # "step i"
    params: float
    params_at: str          # the parameter


@dataclass
class ParityCheck:
    """A finished target against the reference: the deviations and the limits they were held to."""

    max_loss_dev: float
    max_loss_dev_at: str                 # "step i", or why the losses cannot be compared
    loss_limit: float
    first_failing_step: int | None
    max_param_dev: float
    max_param_dev_at: str                # the parameter
    param_limit: float
    losses: list[float]
    recompiles: int | None
    census: bool = False                 # the matmul dtypes were counted (a precision other than fp32)
    matmul_dtypes: dict[str, int] | None = None
    matmul_dtypes_mismatch: str | None = None
    max_eval_loss_dev: float | None = None     # when the program evaluates (index i: the i-th evaluation)
    max_eval_loss_dev_at: str | None = None    # "eval i"
    eval_losses: list[float] | None = None
    fp32_max_loss_dev: float | None = None     # against the reference's fp32 run, when it finished
    bisected: bool = False               # --bisect with both traces: first_divergent_module was looked for
    first_divergent_module: DivergentModule | None = None     # None: every module agrees
    gradients_traced: bool = False       # --bisect, and both stacks gave their gradients
    first_divergent_gradient: DivergentGradient | None = None   # None: every gradient agrees
    param_note: str | None = None        # the parameter's limit came from the reference's own noise (fp32: its
                                         # elements with no true gradient), and what they are
    noise_floor: NoiseFloor | None = None     # fp32, beyond the bounds: the reference's own noise, and the verdict


    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "max_loss_dev": self.max_loss_dev, "max_loss_dev_at": self.max_loss_dev_at, "loss_limit": self.loss_limit,
            "first_failing_step": self.first_failing_step,
            "max_param_dev": self.max_param_dev, "max_param_dev_at": self.max_param_dev_at,
            "param_limit": self.param_limit, "losses": self.losses, "recompiles": self.recompiles,
        }
        if self.census:
            data |= {"matmul_dtypes": self.matmul_dtypes, "matmul_dtypes_mismatch": self.matmul_dtypes_mismatch}
        if self.max_eval_loss_dev is not None:
            data |= {"max_eval_loss_dev": self.max_eval_loss_dev, "max_eval_loss_dev_at": self.max_eval_loss_dev_at,
                     "eval_losses": self.eval_losses}
        if self.fp32_max_loss_dev is not None:
            data["fp32_max_loss_dev"] = self.fp32_max_loss_dev
        if self.bisected:
            found = self.first_divergent_module
            data["first_divergent_module"] = None if found is None else dataclasses.asdict(found)
        if self.gradients_traced:
            grad = self.first_divergent_gradient
            data["first_divergent_gradient"] = None if grad is None else dataclasses.asdict(grad)
        if self.param_note is not None:
            data["max_param_dev_note"] = self.param_note
        if self.noise_floor is not None:
            data["noise_floor"] = dataclasses.asdict(self.noise_floor)
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ParityCheck:
        found, grad = data.get("first_divergent_module"), data.get("first_divergent_gradient")
        return cls(data["max_loss_dev"], data["max_loss_dev_at"], data["loss_limit"], data["first_failing_step"],
                   data["max_param_dev"], data["max_param_dev_at"], data["param_limit"], data["losses"],
                   data["recompiles"], census="matmul_dtypes" in data, matmul_dtypes=data.get("matmul_dtypes"),
                   matmul_dtypes_mismatch=data.get("matmul_dtypes_mismatch"),
                   max_eval_loss_dev=data.get("max_eval_loss_dev"),
                   max_eval_loss_dev_at=data.get("max_eval_loss_dev_at"), eval_losses=data.get("eval_losses"),
                   fp32_max_loss_dev=data.get("fp32_max_loss_dev"),
                   bisected="first_divergent_module" in data,
                   first_divergent_module=None if found is None else DivergentModule(**found),
                   gradients_traced="first_divergent_gradient" in data,
                   first_divergent_gradient=None if grad is None else DivergentGradient(**grad),
                   param_note=data.get("max_param_dev_note"),
                   noise_floor=NoiseFloor(**data["noise_floor"]) if data.get("noise_floor") else None)


@dataclass
class ParityRow:
    """One target: how its process ended and its verdict (pass, FAIL, or error: no result to compare)."""

    target: str
    status: str                      # ok, failed, timeout
    devices: int
    verdict: str
    error: str | None = None         # verdict error: why (first line), then the tail of its stderr
    check: ParityCheck | None = None     # verdict pass or FAIL: the comparison
    cause: str | None = None         # a FAIL explained (random draws, a loss that does not survive a split batch)
    versions: dict[str, str] | None = None   # what it ran on (its environment's frameworks), when it finished

    @property
    def error_line(self) -> str:
        """The first line of the error ("" when there is none)."""
        return self.error.splitlines()[0] if self.error else ""

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"target": self.target, "status": self.status, "devices": self.devices,
                                "verdict": self.verdict}
        data |= {"error": self.error} if self.check is None else self.check.to_json()
        if self.cause is not None:
            data["cause"] = self.cause
        if self.versions is not None:
            data["versions"] = self.versions
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ParityRow:
        check = None if data["verdict"] == "error" else ParityCheck.from_json(data)
        return cls(data["target"], data["status"], data["devices"], data["verdict"], data.get("error"), check,
                   data.get("cause"), data.get("versions"))


@dataclass
class ToleranceRecord:
    """The policy's limits for the run's precision (xbridge/parity/policy.py), as recorded."""

    loss_rtol: float
    param_rtol: float
    why: str

    @classmethod
    def of(cls, tol: Tolerance) -> ToleranceRecord:
        return cls(tol.loss_rtol, tol.param_rtol, tol.why)


@dataclass
class ParityReference:
    """The reference's run: what every target is compared with."""

    target: str
    losses: list[float]
    eval_losses: list[float]
    census: bool = False                 # the matmul dtypes were counted
    matmul_dtypes: dict[str, int] | None = None
    versions: dict[str, str] | None = None   # what the reference ran on

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"target": self.target, "losses": self.losses, "eval_losses": self.eval_losses,
                                "versions": self.versions}
        if self.census:
            data["matmul_dtypes"] = self.matmul_dtypes
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ParityReference:
        return cls(data["target"], data["losses"], data["eval_losses"], "matmul_dtypes" in data,
                   data.get("matmul_dtypes"), data.get("versions"))


@dataclass
class Fp32Reference:
    """The reference run again in fp32 (a precision other than fp32): its rounding noise widens the limits."""

    status: str
    losses: list[float] | None           # None when it did not finish


@dataclass
class NoiseReference:
    """fp32, run only when a target failed on its parameters alone: the reference's own noise on the elements with
    no true gradient (xbridge/parity/noise.py)."""

    run: str                             # how the reference was run again
    status: str                          # that run's status (ok, failed, timeout)
    quiet: dict[str, str]                # per tensor with elements of no true gradient: what they are
    error: str | None = None             # why nothing was lent (the run or step 0's gradient failed)


@dataclass
class RandomDraw:
    """A random draw of one training forward (found on the meta device before anything runs)."""

    module: str
    op: str


@dataclass
class ParityRecord:
    xbridge: str
    program: str
    config_hash: str
    precision: str
    steps: int
    devices: int                     # every device, over all the processes
    processes: int
    tolerance: ToleranceRecord
    reference: ParityReference
    reference_fp32: Fp32Reference | None
    targets: list[ParityRow]
    passed: bool                     # every target's verdict is pass
    rng: str                         # where the forward's random draws came from (native, portable)
    random_draws: list[RandomDraw]
    reference_noise: NoiseReference | None = None    # fp32: measured only when a target failed on parameters alone

    def to_json(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data["tolerance"] = dataclasses.asdict(self.tolerance)
        data["reference"] = self.reference.to_json()
        data["reference_fp32"] = None if self.reference_fp32 is None else dataclasses.asdict(self.reference_fp32)
        data["targets"] = [row.to_json() for row in self.targets]
        data["random_draws"] = [dataclasses.asdict(draw) for draw in self.random_draws]
        if self.reference_noise is None:
            del data["reference_noise"]
        else:
            data["reference_noise"] = dataclasses.asdict(self.reference_noise)
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ParityRecord:
        values = {f.name: data[f.name] for f in dataclasses.fields(cls) if f.name in data}
        values.setdefault("processes", 1)
        values["tolerance"] = ToleranceRecord(**data["tolerance"])
        values["reference"] = ParityReference.from_json(data["reference"])
        fp32 = data["reference_fp32"]
        values["reference_fp32"] = None if fp32 is None else Fp32Reference(**fp32)
        values["targets"] = [ParityRow.from_json(row) for row in data["targets"]]
        values["random_draws"] = [RandomDraw(**draw) for draw in data.get("random_draws", [])]
        noise = data.get("reference_noise")
        values["reference_noise"] = None if noise is None else NoiseReference(**noise)
        return cls(**values)
