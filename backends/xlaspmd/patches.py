"""What the xla stack changes in torch_xla's private API (written for torch_xla 2.9.0; xbridge/torch/patches.py states
the rule and holds the version guard). :func:`apply` runs from ``XlaBackend.lower()``; :func:`undo` puts back what
it changed. (xbridge's XLA kernels, backends/xlaspmd/ops.py and autocast.py, go through the public
``torch.library``: no patch.)

- scan: ``torch_xla.experimental.scan._scan_impl_pytree`` is replaced by backends/xlaspmd/layer_scan_loops.py's
  caching one (torch_xla's autograd function ``Scan`` looks it up in that module at every call), for programs that
  scan their layers, once per process: the ``While`` loops of xbridge's scanned layers are lowered once and reused
  in every step; any other scan goes to torch_xla's function unchanged (layer_scan_loops.py says why). torch_xla
  offers no hook. Undone: torch_xla's function put back.
- the loop's computation (:func:`recording_scans`): while torch_xla lowers a scan of xbridge's for the first time,
  ``torch_xla._XLAC._xla_user_computation`` is wrapped to record the loop computation torch_xla builds and the
  parameters it passes, so that later steps can call the same computation. Put back as soon as that lowering
  returns.
- the TPU generation (:func:`tpu_generation`): while ``xbridge compile`` asks torch_xla which libtpu settings it
  makes on a TPU VM of a generation (``torch_xla._setup_libtpu_flags``, which reads the generation from the VM's
  metadata through ``torch_xla._internal.tpu.version``), that function answers the generation asked for. torch_xla
  takes no generation as an argument. Put back as soon as the settings are read.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from xbridge.torch import patches as shared
from xbridge.torch.patches import Patch, PatchSet

SCAN = Patch("torch_xla.experimental.scan._scan_impl_pytree (scanned layers' loops reused)", "torch_xla",
             shared.TORCH_XLA)
USER_COMPUTATION = Patch("torch_xla._XLAC._xla_user_computation (a scan's loop recorded)", "torch_xla",
                         shared.TORCH_XLA)
TPU_VERSION = Patch("torch_xla._internal.tpu.version (the TPU generation libtpu's settings are made for)", "torch_xla",
                    shared.TORCH_XLA)
_PATCHES = PatchSet(SCAN, USER_COMPUTATION)


def apply(scan_layers: bool) -> None:
    """Check the pins (torch's shared patches' too: the openxla mode compiles the loss with Dynamo); with
    ``scan_layers``, install the caching scan (once per process)."""
    shared.check_all()
    _PATCHES.check()
    if scan_layers:
        _PATCHES.apply(_install)


def undo() -> None:
    _PATCHES.undo()


def _install(patches: PatchSet) -> None:
    import torch_xla.experimental.scan as module

    from . import layer_scan_loops

    patches.set(module, "_scan_impl_pytree", layer_scan_loops.scan_impl_pytree)


def torch_xla_scan(fn: Any, init: Any, xs: Any, reverse: bool = False) -> Any:
    """torch_xla's own ``_scan_impl_pytree`` (the one this stack's patch replaced)."""
    import torch_xla.experimental.scan as module

    return _PATCHES.original(module, "_scan_impl_pytree")(fn, init, xs, reverse=reverse)


@contextlib.contextmanager
def recording_scans(built: list[tuple[list[Any], Any]]) -> Iterator[None]:
    """For the block: each ``xla::scan`` computation torch_xla calls is appended to ``built`` with its parameters
    (and still called)."""
    shared.check(USER_COMPUTATION)
    import torch_xla

    original: Callable[..., Any] = torch_xla._XLAC._xla_user_computation

    def record(name: str, params: Any, computation: Any) -> Any:
        if name == "xla::scan":
            built.append((list(params), computation))
        return original(name, params, computation)

    with shared.replaced(torch_xla._XLAC, {"_xla_user_computation": record}):
        yield


@contextlib.contextmanager
def tpu_generation(generation: int) -> Iterator[None]:
    """For the block: torch_xla reads ``generation`` as this machine's TPU generation."""
    shared.check(TPU_VERSION)
    from torch_xla._internal import tpu

    with shared.replaced(tpu, {"version": lambda: generation}):
        yield
