#!/usr/bin/env bash
# The suite as `make test` runs it (README, .ci/run), in two phases:
#   1. every test not marked serial, on pytest-xdist workers (XBRIDGE_TEST_WORKERS, default one per core, at most 4:
#      the suite keeps a core about half busy when it runs serially, docs/testing.md);
#   2. the tests marked serial, one at a time on an otherwise idle machine: each holds a kill or a hang against a
#      deadline of a few seconds, which a machine loaded by a second worker can miss;
#   3. the xla leg: in .venv-xla (torch 2.9, torch_xla 2.9), the tests marked xla_env (torch_xla in the test process)
#      or both_envs (each environment checks its own stacks). Everything else that runs an xla target does so from
#      .venv, through xbridge's environments (the run goes to .venv-xla's interpreter), in phases 1 and 2.
# Every argument goes to both phases (PYTEST_ARGS="-k checkpoint"); a phase that selects no test is not a failure.
# XBRIDGE_TEST_JUNIT=PREFIX writes each phase's JUnit XML to PREFIX-parallel.xml, -serial.xml and -xla.xml, for
# bench/suite_time.py.
set -uo pipefail
cd "$(dirname "$0")/.."

PY="${XBRIDGE_VENV:-.venv}/bin/python"
XLA_PY="${XBRIDGE_XLA_VENV:-.venv-xla}/bin/python"
SELECT="${XBRIDGE_TEST_MARKS:-not extended}"
workers="${XBRIDGE_TEST_WORKERS:-$(nproc)}"
[ "$workers" -gt 4 ] && workers=4

status=0
junit() { [ -n "${XBRIDGE_TEST_JUNIT:-}" ] && echo "--junitxml=${XBRIDGE_TEST_JUNIT}-$1.xml"; }
phase() {
  local py="$PY"
  [ "$1" = "--xla" ] && { py="$XLA_PY"; shift; }
  "$py" -m pytest "$@"
  local code=$?
  if [ "$code" -ne 0 ] && [ "$code" -ne 5 ]; then status=$code; fi     # 5: no test selected
}
spread=(); [ "$workers" -gt 1 ] && spread=(-n "$workers" --dist worksteal)
phase "${spread[@]}" -m "($SELECT) and not serial and not xla_env" $(junit parallel) "${@}"
phase -m "($SELECT) and serial and not xla_env" $(junit serial) "${@}"
phase --xla "${spread[@]}" -m "($SELECT) and (xla_env or both_envs)" $(junit xla) "${@}"
exit $status
