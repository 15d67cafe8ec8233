#!/usr/bin/env bash
# Install xbridge with every backend into a local virtual environment (.venv by default).
#
# Order matters (docs/architecture.md, "Installing"): the torch_xla wheel carries an old copy of `torchax` that
# overwrites the real one if both come in one pip command, so torchax is installed last, alone, with --no-deps.
# A stamp file keyed on this script and pyproject.toml makes a second call a no-op.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${XBRIDGE_VENV:-.venv}"
TORCHAX="torchax==0.0.13"   # the torchax release that imports on torch 2.9 (0.0.13 breaks on torch >= 2.13)

PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  PY="$(command -v python3.11 || command -v python3 || true)"
fi
if [ -z "$PY" ] || ! "$PY" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
  echo "error: xbridge needs Python 3.11 (torch_xla 2.9 wheels exist for it); set PYTHON=/path/to/python3.11" >&2
  exit 2
fi

stamp="$VENV/.xbridge-installed-$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)"
if [ -f "$stamp" ] && "$VENV/bin/python" -c 'import xbridge' 2>/dev/null; then
  exit 0
fi

echo "== xbridge setup: creating $VENV with $("$PY" --version) (about 3 GB to download on a fresh machine)"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip
"$VENV/bin/python" -m pip install --quiet -e ".[all,test,tpu-compile]"   # tpu-compile: libtpu, ~155 MB
"$VENV/bin/python" -m pip install --quiet --no-deps --force-reinstall "$TORCHAX"
PJRT_DEVICE=CPU "$VENV/bin/python" - <<'PY'
import importlib
for name in ("torch", "torch_xla", "jax", "optax", "torchax", "libtpu", "xbridge"):
    module = importlib.import_module(name)
    print(f"   {name:10s} {getattr(module, '__version__', '?')}")
PY
rm -f "$VENV"/.xbridge-installed-*
touch "$stamp"
echo "== xbridge setup: done"
