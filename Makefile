# `make test`: install what the tests need, start the dev Slurm cluster, run the whole suite.
PYTHON ?= python3
PYTEST_ARGS ?=
# Three pytest-xdist workers on CI's 2 cores: two Slurm test groups (mostly waiting on Slurm's
# clocks) and the CPU-bound modules beside them; tests/conftest.py groups and orders them
# (0: one process, e.g. to debug).
PYTEST_WORKERS ?= 3

.PHONY: install test cluster-start cluster-stop bench

install:
	$(PYTHON) -m pip install -q -e .

test:
	$(PYTHON) -m pip install -q -e '.[dev]'
	bash slurm/dev-cluster.sh start
	eval "$$(bash slurm/dev-cluster.sh env)" && $(PYTHON) -m pytest -n $(PYTEST_WORKERS) --dist loadgroup --no-loadscope-reorder $(PYTEST_ARGS)

cluster-start:
	bash slurm/dev-cluster.sh start

cluster-stop:
	bash slurm/dev-cluster.sh stop

bench:
	eval "$$(bash slurm/dev-cluster.sh env)" && for b in bench/*.py; do $(PYTHON) $$b || exit 1; done
