#!/usr/bin/env bash
# Install xbridge into its three environments (docs/environments.md):
#   .venv        Python 3.11, the suite's frameworks (scripts/pins-2025.txt): eager, inductor, jax; TPU compilation
#   .venv-xla    Python 3.11, the same torch with torch_xla 2.9.0 (its last release, wheels for 3.11 only): xla
#   .venv-today  Python 3.12, the newest frameworks pyproject.toml's ranges allow here (torch 2.14.1, jax 0.12.0)
# and tells the first about the others (`xbridge environments add xla|today ...`): run, parity, compare, check and
# compile start an xla target in .venv-xla's interpreter, and TARGET@today on today's frameworks. A stamp file keyed
# on this script, pyproject.toml and the pins makes a second call a no-op.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${XBRIDGE_VENV:-.venv}"
XLA_VENV="${XBRIDGE_XLA_VENV:-.venv-xla}"
TODAY_VENV="${XBRIDGE_TODAY_VENV:-.venv-today}"
PINS=scripts/pins-2025.txt
stamp_name=".xbridge-installed-$(cat pyproject.toml scripts/setup.sh "$PINS" | sha256sum | cut -c1-16)"

# python_for VERSION: $PYTHON<VERSION without the dot> if set, else pythonVERSION on PATH (pyenv's shim runs it only
# where pyenv selects that version, so pyenv's own copy is tried next).
python_for() {
  local version="$1" var="PYTHON${1/./}" candidate
  if [ -n "${!var:-}" ]; then echo "${!var}"; return; fi
  for candidate in "$(command -v "python$version" || true)" \
                   $(ls -d "$(pyenv root 2>/dev/null || echo /nonexistent)/versions/$version".*/bin/"python$version" 2>/dev/null | sort -V -r); do
    if [ -n "$candidate" ] && "$candidate" -c 'import sys' 2>/dev/null; then echo "$candidate"; return; fi
  done
  echo "error: xbridge's setup needs Python $version (no python$version found; set $var=/path/to/python$version)" >&2
  exit 1
}

# install VENV PYTHON EXTRAS [PIP ARGS...]: a virtual environment with xbridge (editable) and EXTRAS, unless its
# stamp is there
install() {
  local venv="$1" py="$2" extras="$3"
  shift 3
  if [ -f "$venv/$stamp_name" ] && "$venv/bin/python" -c 'import xbridge' 2>/dev/null; then
    return
  fi
  echo "== xbridge setup: $venv with $("$py" --version) and .[$extras]"
  [ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --upgrade pip
  "$venv/bin/python" -m pip install --quiet "$@" -e ".[$extras]"
  if [ "$venv" = "$XLA_VENV" ]; then
    # torch_xla's scan (scanned layers) calls into torchax; the torch_xla wheel carries an old copy of the torchax
    # package without its metadata (it fails to import: No module named 'flax'): the release replaces it
    "$venv/bin/python" -m pip install --quiet --no-deps --force-reinstall "$(grep '^torchax==' "$PINS")"
  fi
  rm -f "$venv"/.xbridge-installed-*
  touch "$venv/$stamp_name"
}

install "$VENV" "$(python_for 3.11)" "all,test,tpu-compile" -c "$PINS"
install "$XLA_VENV" "$(python_for 3.11)" "xla,tensorboard,test,tpu-compile" -c "$PINS"
install "$TODAY_VENV" "$(python_for 3.12)" "all,tpu-compile"
"$VENV/bin/xbridge" environments add xla "$XLA_VENV/bin/python" >/dev/null
"$VENV/bin/xbridge" environments add today "$TODAY_VENV/bin/python" >/dev/null
"$VENV/bin/xbridge" environments
