# The two commands a newcomer needs: `make demo` and `make test`. Both build .venv from nothing.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch first, pinned to the CPU build that the development machines carry; a bare `torch`
# would pull a multi-GB CUDA build.
TORCH_PIN ?= torch==2.13.0

.PHONY: venv demo test test-gpu proto clean

# dflash (z-lab's reference DFLASH draft) is a test oracle: only its model code is used, and its
# pinned requirements (datasets, exact transformers/tqdm/requests versions) would override ours.
$(BIN)/.installed: pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH_PIN)
	$(BIN)/python -m pip install -q -e '.[test,dev]'
	$(BIN)/python -m pip install -q --no-deps dflash==0.1.0
	touch $@

venv: $(BIN)/.installed

demo: venv
	$(BIN)/flashsplit demo

test: venv
	$(BIN)/python -m pytest -q

test-gpu: venv
	$(BIN)/python -m pytest -q -m gpu

proto: venv
	$(BIN)/python proto/generate.py

clean:
	rm -rf $(VENV) build *.egg-info
