"""What ``xbridge compile`` reports: per compiled program (train step, evaluation, initialisation) the TPU
compiler's own figures for one chip, and the derived ones: the bytes a chip needs against its HBM, and for the
train step a roofline lower bound on the step time and the MFU ceiling it implies. Every derived figure is an
estimate from datasheet peaks (xbridge/aot/chips.py): nothing here ran on a TPU."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from .topology import Topology

TRAIN, EVAL, INIT = "train step", "evaluation", "initialisation"


@dataclass
class CompiledProgram:
    """One program as the TPU compiler compiled it, per chip. ``refused``: the compiler's out-of-memory refusal
    (first line), with ``refused_bytes`` where it says how much it needed; the byte fields are then None."""
    name: str
    lower_s: float
    compile_s: float
    argument_bytes: int | None = None
    output_bytes: int | None = None
    alias_bytes: int | None = None          # outputs written over donated arguments
    temp_bytes: int | None = None
    code_bytes: int | None = None
    peak_bytes: int | None = None           # as the compiler reports it (not a superset of the others)
    flops: float | None = None              # XLA's cost analysis (a loop body counted once)
    bytes_accessed: float | None = None
    collectives: dict[str, dict[str, int]] = field(default_factory=dict)
    kernels: int = 0                        # Mosaic (Pallas) custom calls
    refused: str | None = None
    refused_bytes: int | None = None

    @property
    def need_bytes(self) -> int | None:
        """What the chip must hold while the program runs: arguments + outputs - donated + temporaries + code."""
        if self.refused is not None:
            return self.refused_bytes
        parts = (self.argument_bytes, self.output_bytes, self.alias_bytes, self.temp_bytes, self.code_bytes)
        if any(p is None for p in parts):
            return None
        arg, out, alias, temp, code = (int(p or 0) for p in parts)
        return arg + out - alias + temp + code

    def fits(self, hbm: int) -> bool:
        need = self.need_bytes
        return self.refused is None and need is not None and need <= hbm

    def to_json(self, hbm: int) -> dict[str, Any]:
        need = self.need_bytes
        return {**asdict(self), "need_bytes": need, "hbm_bytes": hbm, "fits": self.fits(hbm),
                "margin_bytes": None if need is None else hbm - need}


@dataclass
class Roofline:
    """A lower bound on the train step's time on one chip, the larger of its FLOPs over the chip's peak and its bytes
    over the HBM bandwidth, and the MFU that bound allows. An estimate, labelled so everywhere."""
    flops_per_chip: float
    flops_source: str
    bytes_per_chip: float
    step_s: float
    bound_by: str                # "compute" or "memory bandwidth"
    mfu_ceiling: float | None    # model FLOPs / (bound x peak x chips)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "estimate": True}


def roofline(train: CompiledProgram, topology: Topology, model_flops: int | None, scanned: bool) -> Roofline | None:
    """The bound from XLA's per-chip FLOPs and bytes; with the layers scanned XLA counts the loop body once, so
    the FLOPs are the larger of XLA's and xbridge's model FLOPs shared over the chips."""
    if train.refused is not None or train.flops is None:
        return None
    chip, chips = topology.chip, topology.chips
    flops, source = float(train.flops), "XLA cost analysis"
    per_chip_model = model_flops / chips if model_flops else 0.0
    if scanned and per_chip_model > flops:
        flops, source = per_chip_model, "model FLOPs / chips (XLA counts a scanned loop's body once)"
    moved = float(train.bytes_accessed or 0.0)
    compute_s, memory_s = flops / chip.peak_flops, moved / chip.hbm_bytes_per_s
    step_s = max(compute_s, memory_s)
    if step_s <= 0:
        return None
    mfu = model_flops / (step_s * chip.peak_flops * chips) if model_flops else None
    return Roofline(flops, source, moved, step_s, "compute" if compute_s >= memory_s else "memory bandwidth", mfu)


@dataclass
class CompileReport:
    """``xbridge compile``'s record (``--format json``)."""
    program: str
    target: str
    topology: Topology
    options: dict[str, Any]
    mesh: dict[str, int]
    global_batch: int
    model_flops: int | None
    programs: list[CompiledProgram]
    roofline: Roofline | None
    versions: dict[str, str]
    total_s: float
    dumped: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return all(p.fits(self.topology.chip.hbm_bytes) for p in self.programs)

    def to_json(self) -> dict[str, Any]:
        hbm = self.topology.chip.hbm_bytes
        return {"kind": "xbridge.compile", "program": self.program, "target": self.target,
                "topology": self.topology.to_json(), "options": self.options, "mesh": self.mesh,
                "global_batch": self.global_batch, "model_flops_per_step": self.model_flops,
                "fits": self.fits, "per_chip": {p.name: p.to_json(hbm) for p in self.programs},
                "roofline": self.roofline.to_json() if self.roofline else None, "versions": self.versions,
                "total_s": round(self.total_s, 2), "dumped": self.dumped,
                "note": "compiled for the topology by the TPU compiler on this machine; nothing ran on a TPU: "
                        "bytes and FLOPs are the compiler's, the step time and MFU ceiling are estimates from "
                        "datasheet peaks"}
