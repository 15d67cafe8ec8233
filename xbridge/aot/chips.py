"""What a TPU chip offers, for the per-chip report: HBM as the TPU compiler sizes it, and the datasheet's peak
bf16 FLOP/s and HBM bandwidth (estimates of what a step can reach: nothing here has run on a TPU).

Sources: HBM in bytes is what libtpu 0.0.22's compiler reports as the device's capacity in its own
out-of-memory message (bench/results/tpu-aot/NOTES.md, section 2); peak and bandwidth are Google Cloud's TPU
datasheets, per chip: https://cloud.google.com/tpu/docs/v4 (275 TFLOP/s bf16, 1200 GB/s),
https://cloud.google.com/tpu/docs/v5e (197 TFLOP/s bf16, 819 GB/s), https://cloud.google.com/tpu/docs/v5p
(459 TFLOP/s bf16, 2765 GB/s), https://cloud.google.com/tpu/docs/v6e (918 TFLOP/s bf16, 1640 GB/s). fp32 matmuls
run as bf16 passes on TPUs and no fp32 peak is published: every MFU here is against the bf16 peak.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 2 ** 30


@dataclass(frozen=True)
class Chip:
    generation: str          # v4, v5e, v5p, v6e
    device_kind: str         # PJRT's device_kind, as jax reports it
    hbm_bytes: int           # per chip, as the TPU compiler sizes it
    peak_flops: float        # bf16, dense, per chip (datasheet)
    hbm_bytes_per_s: float   # per chip (datasheet)
    source: str

    def to_json(self) -> dict[str, object]:
        return {"generation": self.generation, "device_kind": self.device_kind, "hbm_bytes": self.hbm_bytes,
                "peak_bf16_flops": self.peak_flops, "hbm_bytes_per_s": self.hbm_bytes_per_s, "source": self.source}


CHIPS = {
    "v4": Chip("v4", "TPU v4", 32 * GIB, 275e12, 1200e9, "https://cloud.google.com/tpu/docs/v4"),
    "v5e": Chip("v5e", "TPU v5 lite", 16 * GIB, 197e12, 819e9, "https://cloud.google.com/tpu/docs/v5e"),
    "v5p": Chip("v5p", "TPU v5", 96 * GIB, 459e12, 2765e9, "https://cloud.google.com/tpu/docs/v5p"),
    "v6e": Chip("v6e", "TPU v6 lite", 33822867456, 918e12, 1640e9, "https://cloud.google.com/tpu/docs/v6e"),
}


def chip_of_kind(device_kind: str) -> Chip | None:
    """The chip whose PJRT device kind is ``device_kind`` (``"TPU v5 lite"``), None for one not in the table."""
    return next((c for c in CHIPS.values() if c.device_kind == device_kind), None)
