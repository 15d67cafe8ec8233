#!/usr/bin/env bash
# The suite as `make test` runs it (README, .ci/run), in two phases:
#   1. every test not marked serial, on pytest-xdist workers (XBRIDGE_TEST_WORKERS, default one per core, at most 4:
#      the suite keeps a core about half busy when it runs serially, docs/testing.md);
#   2. the tests marked serial, one at a time on an otherwise idle machine: each holds a kill or a hang against a
#      deadline of a few seconds, which a machine loaded by a second worker can miss.
# Every argument goes to both phases (PYTEST_ARGS="-k checkpoint"); a phase that selects no test is not a failure.
# XBRIDGE_TEST_JUNIT=PREFIX writes each phase's JUnit XML to PREFIX-parallel.xml and PREFIX-serial.xml, for
# bench/suite_time.py.
set -uo pipefail
cd "$(dirname "$0")/.."

PY="${XBRIDGE_VENV:-.venv}/bin/python"
SELECT="${XBRIDGE_TEST_MARKS:-not extended}"
workers="${XBRIDGE_TEST_WORKERS:-$(nproc)}"
[ "$workers" -gt 4 ] && workers=4

status=0
junit() { [ -n "${XBRIDGE_TEST_JUNIT:-}" ] && echo "--junitxml=${XBRIDGE_TEST_JUNIT}-$1.xml"; }
phase() {
  "$PY" -m pytest "$@"
  local code=$?
  if [ "$code" -ne 0 ] && [ "$code" -ne 5 ]; then status=$code; fi     # 5: no test selected
}
if [ "$workers" -gt 1 ]; then
  phase -n "$workers" --dist worksteal -m "($SELECT) and not serial" $(junit parallel) "${@}"
else
  phase -m "($SELECT) and not serial" $(junit parallel) "${@}"
fi
phase -m "($SELECT) and serial" $(junit serial) "${@}"
exit $status
