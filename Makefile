# The two commands: `make run` (the default job) and `make test` (the whole suite).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test install clean

run: $(STAMP)
	$(VENV)/bin/ditrun $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)

install: $(STAMP)

# torch is pinned first: 2.13.0 has a CPU wheel on disk here, and any looser spec would
# download a multi-GB CUDA build; the project's own `torch>=2.6` is then already satisfied.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,mpi]'
	touch $(STAMP)

clean:
	rm -rf $(VENV) outputs multirun
