"""Framework warnings that say nothing to a user of xbridge, dropped from stderr: each one's meaning is already in
the run record (the target and its device) or does not apply to the run.

- ``WARNING:root:Defaulting to PJRT_DEVICE=CPU``: torch_xla, imported by a library's availability check
  (transformers', diffusers' ``is_torch_xla_available``) in a process that does not run torch_xla, picks its
  default device and says so; the xla targets set ``PJRT_DEVICE`` themselves (backends/xlaspmd).
- ``No CUDA runtime is found, using CUDA_HOME=...``: torch.utils.cpp_extension, imported by Inductor's C++ code
  cache on a machine with a CUDA toolkit and no GPU; the run record names the device the run used.

Only these exact messages are dropped (a logging filter on the logger that emits each); everything else a
framework logs still reaches stderr."""

from __future__ import annotations

import logging

# logger name -> the start of the messages dropped from it
NOISE = {
    "root": ("Defaulting to PJRT_DEVICE=CPU",),
    "torch.utils.cpp_extension": ("No CUDA runtime is found",),
}


class _Drop(logging.Filter):
    def __init__(self, starts: tuple[str, ...]) -> None:
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.starts)


def silence() -> None:
    """Install the filters (once per process; imports no framework)."""
    for name, starts in NOISE.items():
        logger = logging.getLogger() if name == "root" else logging.getLogger(name)
        if not any(isinstance(f, _Drop) for f in logger.filters):
            logger.addFilter(_Drop(starts))
