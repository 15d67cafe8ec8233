"""What ``xbridge compare`` produces, typed: the job builds a :class:`CompareRecord`, one :class:`CompareRow` per
target (how its process ended, its run record and the derived :class:`TargetMetrics`); ``results.json`` and
``xbridge compare --format json`` are its :meth:`CompareRecord.to_json`, read back with
:meth:`CompareRecord.from_json`. The tables, the CSV, the plots and ``report.md`` read its fields."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..run.isolated import TargetRun
from ..run.record import RunRecord
from .estimates import EstimateRow
from .options import CompareOptions
from .recommend import Recommendation


@dataclass
class TargetMetrics:
    """A finished target's row of the comparison."""

    compile_s: float
    compile_cache: str | None      # warm, cold, partial, unused (CompileCache.state); None: nothing compiled
    step_ms_median: float
    step_ms_p10: float
    step_ms_p90: float
    samples_per_s: float
    tokens_per_s: float
    achieved_tflops: float
    peak_tflops: float
    mfu: float
    peak_source: str
    peak_host_rss_mib: float
    device_peak_mib: float | None
    recompiles: int | None
    final_loss: float
    max_loss_dev: float | None = None      # against the reference, when it finished
    max_loss_dev_at: str | None = None     # e.g. "step 3"
    loss_parity: bool | None = None
    final_loss_dev: float | None = None
    eval_loss: float | None = None         # the last xb.Eval loss, when the program evaluates
    attention: str | None = None           # the attention kernel(s) that ran, e.g. "flash (CPU) x4"; "-" for none
    steps_host_rss_mib: float | None = None    # what the steps added to the peak host RSS (the run's own memory)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TargetMetrics:
        return cls(**{f.name: data[f.name] for f in dataclasses.fields(cls) if f.name in data})


@dataclass
class CompareRow(TargetRun):
    """One target: how its process ended (xbridge/run/isolated.py's TargetRun), and when it finished, its run
    record, the derived metrics and its per-step losses."""

    metrics: TargetMetrics | None = None
    losses: list[float] | None = None

    @property
    def error_line(self) -> str:
        """The first line of the error ("" when there is none)."""
        return self.error.splitlines()[0] if self.error else ""

    @property
    def finished(self) -> TargetMetrics:
        """The metrics of a target whose status is ok."""
        assert self.metrics is not None, f"{self.target} has no metrics (status {self.status})"
        return self.metrics

    def to_json(self) -> dict[str, Any]:
        data = super().to_json()
        if self.metrics is not None:
            data["metrics"] = self.metrics.to_json()
        if self.losses is not None:
            data["losses"] = self.losses
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CompareRow:
        return cls(data["target"], data["devices"], data["command"], data["status"], data.get("error"),
                   RunRecord.from_json(data["result"]) if "result" in data else None,
                   TargetMetrics.from_json(data["metrics"]) if "metrics" in data else None, data.get("losses"))


@dataclass
class CompareRecord:
    xbridge: str
    program: str
    program_file: str
    config: dict[str, Any]
    config_hash: str
    precision: str
    machine: dict[str, Any]
    measured_at: str                 # "%Y-%m-%d %H:%M UTC"
    options: CompareOptions
    flops_per_step: int
    reference: str                   # the target the loss deviations are taken against
    loss_limit: float                # the parity policy's loss tolerance for the precision
    provenance: dict[str, Any]       # command line, program file, its git commit/dirty
    targets: list[CompareRow]
    estimates: list[EstimateRow] = dataclasses.field(default_factory=list)   # compile-only rows (--topology)
    recommendation: Recommendation | None = None     # the target to run (None: --no-recommend)
    version_pairs: list[Any] = dataclasses.field(default_factory=list)   # compare/versions.py: a target in two envs
    shared_init: dict[str, str] | None = None   # targets in several environments: where each ran ("here" or a
                                                # name); every one started from initial_weights.npz
    written: list[str] | None = None     # the files written under --out (not in results.json itself)

    @property
    def passed(self) -> bool:
        """Every target finished, and every compile-only one compiled."""
        return all(row.status == "ok" for row in self.targets) and all(e.status == "ok" for e in self.estimates)

    def to_json(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data["options"] = self.options.to_json()
        data["targets"] = [row.to_json() for row in self.targets]
        data["estimates"] = [row.to_json() for row in self.estimates]
        data["recommendation"] = None if self.recommendation is None else self.recommendation.to_json()
        data["version_pairs"] = [pair.to_json() for pair in self.version_pairs]
        if self.written is None:
            del data["written"]
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CompareRecord:
        values = {f.name: data[f.name] for f in dataclasses.fields(cls) if f.name in data}
        values["options"] = CompareOptions.from_json(data["options"])
        values["targets"] = [CompareRow.from_json(row) for row in data["targets"]]
        values["estimates"] = [EstimateRow.from_json(row) for row in data.get("estimates", [])]
        from .versions import VersionPair

        values["version_pairs"] = [VersionPair.from_json(pair) for pair in data.get("version_pairs", [])]
        if data.get("recommendation") is not None:
            values["recommendation"] = Recommendation.from_json(data["recommendation"])
        return cls(**values)
