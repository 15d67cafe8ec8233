# The two commands of the README. Each installs into .venv first when needed (scripts/setup.sh).
PYTEST_ARGS ?=

.PHONY: setup run test clean

setup:
	@bash scripts/setup.sh

# The main job: the shipped GPT program on every target this machine has, side by side.
run: setup
	.venv/bin/xbridge compare programs/gpt.py --steps 20 --out out/compare-gpt

# The whole test suite.
test: setup
	.venv/bin/python -m pytest $(PYTEST_ARGS)

clean:
	rm -rf .venv out .pytest_cache
