# `make test`: install what the tests need, start the dev Slurm cluster, run the whole suite.
PYTHON ?= python3
PYTEST_ARGS ?=

.PHONY: install test cluster-start cluster-stop bench

install:
	$(PYTHON) -m pip install -q -e .

test:
	$(PYTHON) -m pip install -q -e '.[dev]'
	bash slurm/dev-cluster.sh start
	eval "$$(bash slurm/dev-cluster.sh env)" && $(PYTHON) -m pytest $(PYTEST_ARGS)

cluster-start:
	bash slurm/dev-cluster.sh start

cluster-stop:
	bash slurm/dev-cluster.sh stop

bench:
	eval "$$(bash slurm/dev-cluster.sh env)" && for b in bench/*.py; do $(PYTHON) $$b || exit 1; done
