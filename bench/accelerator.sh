#!/usr/bin/env bash
# The accelerator check: on a machine with a GPU, one script that
#   1. installs what is missing (from the package registry, or from wheels in .whl/ where the machine has none),
#   2. runs `xbridge backends`,
#   3. `xbridge parity programs/gpt.py` in fp32 and bf16-mixed against eager-cuda (inductor-cuda, jax-cuda),
#   4. `xbridge compare programs/gpt.py:gpt2_small` (GPT-2-small class, bf16-mixed) on eager-cuda, inductor-cuda and
#      jax-cuda, then a torch.profiler table of where a step's GPU time goes (bench/accelerator_profile.py),
# and writes everything under one folder (default bench/results/accelerator), with a compact summary printed last
# (bench/accelerator_summary.py, also summary.md: the table of docs/results.md). Sized to finish within 8 minutes
# on one H100/H200-class GPU. Never run by the tests: it needs a GPU.
#
#   bash bench/accelerator.sh [RESULTS_DIR]
#   bash bench/accelerator.sh --prepare-offline   # here, with a registry: fill .whl/ for a machine without one
set -uo pipefail
cd "$(dirname "$0")/.."

PY="${PYTHON:-python3}"
# The packages xbridge's core, the torch backends and the jax backend import (module names).
NEEDED="numpy typer rich matplotlib safetensors sklearn grain torch jax optax torchax xbridge"
# What the offline folder carries: the packages a CUDA image with torch and jax usually lacks, and xbridge itself.
OFFLINE="torchax==0.0.13 grain==0.2.18 array-record portpicker"

if [ "${1:-}" = "--prepare-offline" ]; then
  # Wheels for the target machine's Python (PY_TARGET, default 3.12) into .whl/, plus xbridge's own wheel.
  target="${PY_TARGET:-3.12}"
  mkdir -p .whl
  platforms=""
  for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
           manylinux2014_x86_64 manylinux1_x86_64 any; do platforms="$platforms --platform $p"; done
  for spec in $OFFLINE; do
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$target" --implementation cp \
      $platforms -d .whl "$spec" || exit 1
  done
  rm -f .whl/xbridge-*.whl
  "$PY" -m pip wheel -q --no-deps --no-build-isolation -w .whl . || exit 1
  ls -1 .whl
  exit 0
fi

RESULTS="${1:-bench/results/accelerator}"
mkdir -p "$RESULTS"
LOG="$RESULTS/log.txt"
: > "$LOG"
say() { echo "== $*" | tee -a "$LOG"; }
start=$(date +%s)

missing() { "$PY" - "$@" <<'PYEOF'
import importlib.util, sys
print(" ".join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is None))
PYEOF
}

# 1. Install what is missing.
gone="$(missing $NEEDED)"
if [ -n "$gone" ]; then
  say "missing: $gone"
  if ls .whl/*.whl >/dev/null 2>&1; then
    # No registry here: the carried wheels, into a folder of their own (the machine's packages stay as they are).
    # xbridge's wheel says Python 3.11 (torch_xla's pin); the CUDA path needs no torch_xla, so 3.12 is accepted.
    site="${XBRIDGE_SITE:-/tmp/xbridge-site}"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --ignore-requires-python --target "$site" \
      .whl/*.whl 2>&1 | tee -a "$LOG"
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    # the installed xbridge, not the source folder in the working directory (whose backends/ sits beside it)
    export PYTHONSAFEPATH=1
  else
    # A registry: xbridge with the jax backend and JAX's CUDA plugin at the pinned jax (the `cuda` extra), then
    # torchax alone (scripts/setup.sh says why).
    "$PY" -m pip install -q -e ".[jax,cuda]" 2>&1 | tee -a "$LOG"
    "$PY" -m pip install -q --no-deps torchax==0.0.13 2>&1 | tee -a "$LOG"
  fi
  gone="$(missing $NEEDED)"
  if [ -n "$gone" ]; then
    say "error: still missing after the install: $gone"
    exit 1
  fi
fi
XB=("$PY" -m xbridge)
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader \
  > "$RESULTS/gpu.txt" 2>&1
"$PY" - > "$RESULTS/versions.txt" 2>&1 <<'PYEOF'
import importlib.metadata as md, platform
print("python", platform.python_version())
for d in ("torch", "jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda13-plugin", "torchax", "optax", "triton", "xbridge"):
    try:
        print(d, md.version(d))
    except md.PackageNotFoundError:
        pass
PYEOF

# 2. Which targets this machine has.
say "xbridge backends"
"${XB[@]}" backends --format json > "$RESULTS/backends.json" 2>>"$LOG"
"${XB[@]}" backends 2>&1 | tee -a "$LOG"

# 3. Parity of the small GPT against eager on the GPU (several runs at a time: parity compares results, not
# timings). JAX takes half the GPU's memory, not its default 75%, as it shares the GPU with the torch runs here.
# (REFERENCE, TARGETS and BIG may be overridden, e.g. to try the script on a CPU: REFERENCE=eager-cpu
# TARGETS=jax-cpu BIG=programs/gpt.py)
REFERENCE="${REFERENCE:-eager-cuda}"
TARGETS="${TARGETS:-inductor-cuda,jax-cuda}"
BIG="${BIG:-programs/gpt.py:gpt2_small}"
for precision in fp32 bf16-mixed; do
  say "parity programs/gpt.py $precision ($(( $(date +%s) - start )) s)"
  XLA_PYTHON_CLIENT_MEM_FRACTION=0.5 timeout 240 "${XB[@]}" parity programs/gpt.py --reference "$REFERENCE" \
    --backends "$TARGETS" --precision "$precision" --steps "${PARITY_STEPS:-10}" --jobs 3 --format json \
    --out "$RESULTS/parity-$precision" > "$RESULTS/parity-$precision.json" 2>>"$LOG"
  echo "   exit $?" | tee -a "$LOG"
done

# 4. The race: GPT-2-small class in bf16-mixed, each target alone on the GPU.
say "compare $BIG bf16-mixed ($(( $(date +%s) - start )) s)"
timeout 300 "${XB[@]}" compare "$BIG" --reference "$REFERENCE" \
  --backends "$REFERENCE,$TARGETS" --precision bf16-mixed --steps "${COMPARE_STEPS:-30}" --warmup 10 \
  --format json --out "$RESULTS/compare" > "$RESULTS/compare.json" 2>>"$LOG"
echo "   exit $?" | tee -a "$LOG"

say "profile: where a GPT-2-small step's GPU time goes ($(( $(date +%s) - start )) s)"
timeout 150 "$PY" bench/accelerator_profile.py > "$RESULTS/profile.txt" 2>>"$LOG"
echo "   exit $?" | tee -a "$LOG"

say "summary ($(( $(date +%s) - start )) s in all)"
"$PY" bench/accelerator_summary.py "$RESULTS"
