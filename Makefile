# Every target creates .venv on its own; torch is pinned to the local CPU wheel (see pyproject.toml).
PY := .venv/bin/python
STAMP := .venv/.installed

.PHONY: demo test test-slow bench clean bytecode

$(STAMP): pyproject.toml
	python3 -m venv .venv
	$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install -q --disable-pip-version-check -e '.[test]'
	touch $(STAMP)

# meshtron's modules compiled once: where the environment sets PYTHONDONTWRITEBYTECODE (this
# machine and CI do), every process would otherwise compile them again, 0.4-0.5 s of CPU per
# process (the suite starts ~650; measured 2026-12-07). Stale files are recompiled here.
bytecode: $(STAMP)
	$(PY) -m compileall -q meshtron testkit

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
