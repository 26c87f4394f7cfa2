# Each target creates its own virtualenv (.venv) on first use.
# TORCH picks the PyTorch build: the default is the CPU build used by CI; on a GPU machine
# run e.g. `make install TORCH="torch>=2.5"` to keep/get a CUDA build.
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install quickstart test test-all clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check "$(TORCH)"
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

quickstart: $(STAMP)
	$(BIN)/scratchlm quickstart

test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) runs/quickstart
