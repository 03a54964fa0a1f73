# `make test` and `make demo` create the environment themselves when it is missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
export PIP_CONSTRAINT := $(CURDIR)/constraints.txt
export PYTHONUNBUFFERED := 1

.PHONY: venv test test-fast bench quickstart clean

$(VENV)/.installed: pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -c constraints.txt torch==2.13.0
	$(PY) -m pip install -q --disable-pip-version-check -c constraints.txt -e '.[dev]'
	touch $@

venv: $(VENV)/.installed

test: venv
	$(PY) -m pytest -q

test-fast: venv
	$(PY) -m pytest -q -m 'not slow'

bench: venv
	$(PY) bench/step_time.py

quickstart: venv
	$(VENV)/bin/vlaforge train recipes/tiny_metaworld.toml --data.source=synthetic --train.steps=50 --train.output_dir=runs/quickstart

clean:
	rm -rf $(VENV) runs .pytest_cache
