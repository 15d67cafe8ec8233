#!/usr/bin/env bash
# Install xbridge into its two environments (docs/environments.md):
#   .venv      Python 3.12, today's frameworks (scripts/pins.txt: torch 2.14.1, jax 0.12.0.1, torchax's nightly):
#              eager, inductor, jax; TPU compilation
#   .venv-xla  Python 3.11, torch 2.9.0 with torch_xla 2.9.0 (its last release, wheels for 3.11 only; scripts/
#              pins-xla.txt): xla, and eager and inductor on torch 2.9 (TARGET@xla: the upgrade question)
# and tells the first about the second (`xbridge environments add xla ...`): run, parity, compare, check and compile
# start an xla target in .venv-xla's interpreter. A stamp file keyed on this script, pyproject.toml and the pins
# makes a second call a no-op.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${XBRIDGE_VENV:-.venv}"
XLA_VENV="${XBRIDGE_XLA_VENV:-.venv-xla}"
PINS=scripts/pins.txt
XLA_PINS=scripts/pins-xla.txt
stamp_name=".xbridge-installed-$(cat pyproject.toml scripts/setup.sh "$PINS" "$XLA_PINS" | sha256sum | cut -c1-16)"

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
    "$venv/bin/python" -m pip install --quiet --no-deps --force-reinstall "$(grep '^torchax==' "$XLA_PINS")"
  fi
  rm -f "$venv"/.xbridge-installed-*
  touch "$venv/$stamp_name"
}

# A .venv made by an earlier setup on Python 3.11 is made again on 3.12
if [ -x "$VENV/bin/python" ] && ! "$VENV/bin/python" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))'; then
  echo "== xbridge setup: $VENV is not Python 3.12; making it again"
  rm -rf "$VENV"
fi
install "$VENV" "$(python_for 3.12)" "all,test,tpu-compile" -c "$PINS"
install "$XLA_VENV" "$(python_for 3.11)" "xla,tensorboard,test,tpu-compile" -c "$XLA_PINS"
"$VENV/bin/xbridge" environments add xla "$XLA_VENV/bin/python" >/dev/null
"$VENV/bin/xbridge" environments
