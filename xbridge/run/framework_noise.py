"""Framework warnings that say nothing to a user of xbridge, dropped from stderr: each one's meaning is already in
the run record (the target and its device) or does not apply to the run.

- ``WARNING:root:Defaulting to PJRT_DEVICE=CPU``: torch_xla, imported by a library's availability check
  (transformers', diffusers' ``is_torch_xla_available``) in a process that does not run torch_xla, picks its
  default device and says so; the xla targets set ``PJRT_DEVICE`` themselves (backends/xlaspmd).
- ``No CUDA runtime is found, using CUDA_HOME=...``: torch.utils.cpp_extension, imported by Inductor's C++ code
  cache on a machine with a CUDA toolkit and no GPU; the run record names the device the run used.
- ``Profiler function <class 'torch.autograd.profiler.record_function'> will be ignored`` (torch 2.9; from torch
  2.14 ``Profiler record function ... will be ignored``, logged by Dynamo's context managers): Dynamo, compiling
  ``torch.optim``'s step (inductor), which marks itself with ``record_function`` for the profiler; compiled code
  carries no such marks, and the run's own profile (``--profile``) names the compiled kernels instead.

Only these exact messages are dropped (a logging filter on the logger that emits each); everything else a
framework logs still reaches stderr.

Native code logs to file descriptor 2 itself, past Python's logging: :func:`native_lines_dropped` catches what one
call writes there and passes on every line but the listed ones. Used for:

- ``E ... python_hooks.cc:416] Can't import tensorflow.python.profiler.trace``: jaxlib's profiler (jax 0.7.1)
  looks for TensorFlow's TraceMe hooks when a trace starts and stops, and logs at ERROR where TensorFlow is not
  installed, twice a ``--profile`` on jax; the trace is complete without them.

Native code writes to file descriptor 1 too, where xbridge's own output is (``--format json`` is read from it):
:func:`native_stdout_to_stderr` sends what it writes there to stderr, less the lines of ``STDOUT_NOISE``:

- ``[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1``: Gloo, jaxlib
  0.12's CPU collectives, each time a process of a several-process job connects to its peers (several times a
  run); the run record names the processes."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
from collections.abc import Iterator

# logger name -> the start of the messages dropped from it
NOISE = {
    "root": ("Defaulting to PJRT_DEVICE=CPU",),
    "torch.utils.cpp_extension": ("No CUDA runtime is found",),
    "torch._dynamo.variables.torch": ("Profiler function",),
    "torch._dynamo.variables.ctx_manager": ("Profiler record function",),
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


# what native code writes to stderr that is dropped: a fragment of each such line
NATIVE_NOISE = ("Can't import tensorflow.python.profiler.trace",)
# what native code writes to stdout that is dropped (the rest of it goes to stderr): a fragment of each such line
STDOUT_NOISE = (b"[Gloo] Rank ", b"Expected number of connected peer ranks")


def native_stdout_to_stderr() -> None:
    """From here on, file descriptor 1 is a pipe whose lines a thread passes to stderr, less ``STDOUT_NOISE``;
    ``sys.stdout`` writes to a copy of the real stdout, which then holds only what xbridge prints (its tables, the
    JSON of ``--format json``). Only where ``sys.stdout`` is this process's descriptor 1 (not when the CLI runs
    in-process with its streams captured); once per process. A child process that is to print to the real stdout
    is given ``sys.stdout`` (xbridge/processes/supervisor.py)."""
    import atexit
    import threading

    stream = sys.stdout
    try:
        if id(stream) != id(sys.__stdout__) or stream.fileno() != 1:    # id: no narrowing to Optional
            return
    except (AttributeError, OSError, ValueError):
        return
    stream.flush()
    real = os.dup(1)
    read_end, write_end = os.pipe()
    os.dup2(write_end, 1)
    os.close(write_end)
    line_buffered = bool(getattr(stream, "line_buffering", False))
    sys.stdout = open(real, "w", encoding=stream.encoding, errors=getattr(stream, "errors", None),
                      buffering=1 if line_buffered else -1)

    def relay() -> None:
        with open(read_end, "rb", buffering=0) as lines:
            for line in iter(lines.readline, b""):
                if not any(fragment in line for fragment in STDOUT_NOISE):
                    os.write(2, line)

    thread = threading.Thread(target=relay, name="xbridge-native-stdout", daemon=True)
    thread.start()

    def drain() -> None:
        # what C's stdio still buffers for descriptor 1 (a pipe: block-buffered; Gloo's lines wait there) goes
        # through the relay now, not straight to stderr when the process exits after this
        with contextlib.suppress(OSError, AttributeError):
            import ctypes

            ctypes.CDLL(None).fflush(None)
        with contextlib.suppress(OSError):
            os.dup2(2, 1)           # this process's write end closed: the relay reads to the end (children's
        thread.join(timeout=2.0)    # copies of it, if any are still running, are not waited for)

    atexit.register(drain)


@contextlib.contextmanager
def native_lines_dropped(fragments: tuple[str, ...] = NATIVE_NOISE) -> Iterator[None]:
    """File descriptor 2 goes to a temporary file for the block; its lines then reach the real stderr, except those
    containing one of ``fragments``. For short calls only (a line written by another thread meanwhile comes late)."""
    sys.stderr.flush()
    with tempfile.TemporaryFile() as caught:
        saved = os.dup(2)
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            kept = [line for line in caught.read().splitlines(keepends=True)
                    if not any(f.encode() in line for f in fragments)]
            if kept:
                os.write(2, b"".join(kept))
