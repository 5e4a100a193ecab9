# Every target creates .venv on its own; torch is pinned to the local CPU wheel (see pyproject.toml).
PY := .venv/bin/python
STAMP := .venv/.installed

.PHONY: demo test test-slow bench clean

$(STAMP): pyproject.toml
	python3 -m venv .venv
	$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install -q --disable-pip-version-check -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m meshtron demo

test: $(STAMP)
	$(PY) -m pytest -q -x --durations=15

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

bench: $(STAMP)
	$(PY) bench/planner_speed.py

clean:
	rm -rf .venv runs .pytest_cache
