# The two commands of the README. Each installs into .venv first when needed (scripts/setup.sh).
PYTEST_ARGS ?=

.PHONY: setup run test clean

setup:
	@bash scripts/setup.sh

# The main job: the shipped GPT program on the reference backend.
run: setup
	.venv/bin/xbridge run programs/gpt.py --backend eager-cpu --steps 40 --out out/gpt-eager-cpu

# The whole test suite.
test: setup
	.venv/bin/python -m pytest $(PYTEST_ARGS)

clean:
	rm -rf .venv out .pytest_cache
