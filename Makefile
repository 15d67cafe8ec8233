# The two commands of the README. Each installs into .venv first when needed (scripts/setup.sh).
PYTEST_ARGS ?=

.PHONY: setup run test test-extended test-all test-fast lint clean

setup:
	@bash scripts/setup.sh

# The main job: the shipped GPT program on every target this machine has, side by side.
run: setup
	.venv/bin/xbridge compare programs/gpt.py --steps 20 --out out/compare-gpt

# The whole suite, as CI runs it: lint and type check, then every test (scripts/test.sh: on a worker per core, then
# the tests marked serial alone).
test: setup lint
	bash scripts/test.sh $(PYTEST_ARGS)

# The tests marked extended (docs/testing.md: each repeats a suite test at more devices, in another precision or on
# another model; about 11 minutes on 2 cores), and everything at once.
test-extended: setup
	XBRIDGE_TEST_MARKS=extended bash scripts/test.sh $(PYTEST_ARGS)

test-all: setup lint
	XBRIDGE_TEST_MARKS="extended or not extended" bash scripts/test.sh $(PYTEST_ARGS)

# For iteration: the tests not marked slow (under 3 minutes).
test-fast: setup
	XBRIDGE_TEST_MARKS="not slow and not extended" bash scripts/test.sh $(PYTEST_ARGS)

# ruff (lint and import order) and mypy over the package, as CI runs them.
lint: setup
	.venv/bin/ruff check .
	.venv/bin/mypy

clean:
	rm -rf .venv .venv-xla .venv-today out .pytest_cache
