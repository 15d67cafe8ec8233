"""What a run produces, typed: the run loop builds a :class:`RunRecord`; ``run.json`` and ``xbridge run --format
json`` are its :meth:`RunRecord.to_json`; compare and parity read a target's result back with
:meth:`RunRecord.from_json`. The JSON keeps the field names below (``RECORD_VERSION`` counts changes)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

RECORD_VERSION = 3   # 2: data (the sources described), evals, steps carry data_wait_s and data_bytes; 3: provenance


@dataclass
class StepRecord:
    step: int
    loss: float
    time_s: float
    metrics: dict[str, float] = field(default_factory=dict)    # what the executable reported besides the loss

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "loss": self.loss, **self.metrics, "time_s": self.time_s}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StepRecord:
        extra = {k: v for k, v in data.items() if k not in ("step", "loss", "time_s")}
        return cls(int(data["step"]), float(data["loss"]), float(data["time_s"]), extra)


@dataclass
class EvalRecord:
    step: int                   # completed training steps when it ran (0: the initial weights)
    loss: float                 # mean over the eval batches
    perplexity: float | None    # exp(loss), for token data
    batches: int
    time_s: float

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> EvalRecord:
        return cls(**{f.name: data[f.name] for f in dataclasses.fields(cls)})


@dataclass
class RunSummary:
    compile_s: float                 # the first step: tracing, compilation and one step
    warmup_steps: int
    timed_steps: int
    step_time_median_s: float
    step_time_p10_s: float
    step_time_p90_s: float
    samples_per_s: float
    tokens_per_s: float
    first_loss: float
    final_loss: float
    recompiles_after_warmup: int | None = None    # None when nothing ran after warm-up
    recompile_reasons: list[str] | None = None    # only when there were recompiles and the backend knows why
    matmul_dtypes: dict[str, int] | None = None   # --matmul-dtypes: the forward's matrix products by dtype
    attention: dict[str, int] | None = None       # the forward's attention calls by kernel ({}: none; None: unknown)

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        for optional in ("recompile_reasons", "matmul_dtypes", "attention"):
            if data[optional] is None:
                del data[optional]
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RunSummary:
        values: dict[str, Any] = {f.name: data[f.name] for f in dataclasses.fields(cls) if f.name in data}
        return cls(**values)


@dataclass
class RunRecord:
    xbridge: str
    program: str
    config: dict[str, Any]
    config_hash: str
    target: str
    backend_options: dict[str, str]
    precision: str
    devices: int
    mesh: dict[str, int]
    param_bytes_per_device: int
    versions: dict[str, str]
    machine: dict[str, Any]
    start_step: int
    resumed_from: str | None
    config_changes: list[str]
    checkpoints: list[str]
    steps: list[StepRecord]
    summary: RunSummary
    dumped: list[str]
    device_kind: str
    device_peak_bytes: int | None
    peak_host_rss_bytes: int
    layout: dict[str, dict[str, Any]]
    compile_cache: dict[str, Any] | None = None   # CompileCache.to_json(): hits, misses, state, caches, seconds
    rng: str = "native"       # where the forward's random draws came from (StepOptions.rng)
    data: dict[str, Any] = field(default_factory=dict)    # the source's description and whether it is reproducible
    evals: list[EvalRecord] = field(default_factory=list)
    written: str | None = None        # where run.json went (--out)
    # the peak host RSS before the first step (model built and placed): what the steps themselves added to the
    # process's peak is peak_host_rss_bytes less this (on CPU, where no device memory counter exists)
    host_rss_before_steps_bytes: int | None = None
    provenance: dict[str, Any] = field(default_factory=dict)   # command line, program file, its git commit/dirty
    profile: dict[str, Any] | None = None     # --profile: the trace files and their summary (xbridge/run/profile.py)
    processes: int = 1        # --processes: how many processes the devices were spread over (devices: all of them)
    restarts: list[dict[str, Any]] = field(default_factory=list)    # --max-restarts: each restart of the job
    record_version: int = RECORD_VERSION

    @property
    def losses(self) -> list[float]:
        return [s.loss for s in self.steps]

    @property
    def final_eval(self) -> EvalRecord | None:
        return self.evals[-1] if self.evals else None

    def to_json(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data["steps"] = [s.to_json() for s in self.steps]
        data["summary"] = self.summary.to_json()
        data["evals"] = [e.to_json() for e in self.evals]
        if self.written is None:
            del data["written"]
        if self.profile is None:
            del data["profile"]
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RunRecord:
        values = {f.name: data[f.name] for f in dataclasses.fields(cls) if f.name in data}
        values["steps"] = [StepRecord.from_json(s) for s in data["steps"]]
        values["summary"] = RunSummary.from_json(data["summary"])
        values["evals"] = [EvalRecord.from_json(e) for e in data.get("evals", [])]
        return cls(**values)
