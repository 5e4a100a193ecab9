# Every target creates .venv on its own; torch is pinned to the local CPU wheel (see pyproject.toml).
PY := .venv/bin/python
STAMP := .venv/.installed
PIP := $(PY) -m pip install -q --disable-pip-version-check --no-compile

# Bytecode is written where a module is first imported, once. Where the environment sets
# PYTHONDONTWRITEBYTECODE (this machine and CI do), every process would compile again what it
# imports: 0.4-0.5 s of CPU for meshtron's modules alone, and the suite starts ~650 processes.
# pip's own compilation (--no-compile here) covered every file of torch, transformers, ...
# whether imported or not: 41 of the 92 s the venv took (measured 2026-12-07).
unexport PYTHONDONTWRITEBYTECODE
# What nearly every process imports, compiled once by one process before the suite starts: else
# the first processes, started together, each compile torch's ~1,500 modules (~9 CPU s each).
WARM := torch, torch._dynamo, torch.distributed.tensor, torch.distributed.fsdp, \
	torch.distributed.pipelining, torch.distributed.checkpoint, numpy, matplotlib.pyplot, rich.console

.PHONY: demo test test-slow bench clean bytecode

$(STAMP): pyproject.toml
	python3 -m venv .venv
	$(PIP) torch==2.13.0
	$(PIP) -e '.[test]'
	touch $(STAMP)

bytecode: $(STAMP)
	$(PY) -m compileall -q -j 0 meshtron testkit
	$(PY) -c "import $(WARM)"

demo: bytecode
	$(PY) -m meshtron demo

# Two workers (pytest-xdist): the suite's processes leave one of the CI machine's two cores idle
# half the time; a test file stays on one worker, so its module fixtures run once.
TEST_WORKERS ?= 2

test: bytecode
	$(PY) -m pytest -q -x -n $(TEST_WORKERS) --dist loadfile --durations=15

test-slow: bytecode
	$(PY) -m pytest -q -m slow

bench: $(STAMP)
	$(PY) bench/planner_speed.py

clean:
	rm -rf .venv runs .pytest_cache
