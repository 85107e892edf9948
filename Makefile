# Two commands: `make demo` (the main job) and `make test` (the whole suite).
# Both create .venv and install what they need. Override the torch build for ROCm or CUDA, e.g.
#   make test TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/rocm6.4"
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
# The suite runs on this many pytest-xdist workers, a test file per worker (files that share a
# module's fixtures, such as a chaos reference run, keep them); TEST_WORKERS=0 runs it in one process.
# Files are handed out in the order tests/conftest.py sorts them (the long ones first), not
# pytest-xdist's default (the files with the most tests first, which put the real jobs last).
# Five on two cores: the real jobs of the chaos files wait (for timeouts, verdicts, restarts) as
# much as they compute, and more files fill those waits (on two cores under load, measured:
# 976 s with three workers against 1311 s with two; unloaded, 848 s with four against 901 s with
# three).  Beyond four the cores are busy throughout unloaded (measured with 815 tests: 1059 s
# with four, 1035 s with six, vmstat idle 0%), but under load a fifth takes a larger share of
# them from the other processes (1,765 tests with two busy loops: 944, 958, 974 and 988 s with
# five, 963 and 995 s with four, as the machine slowed through the day: 1-2%, near the noise;
# BENCHMARKS.md, thirty-eighth session).
TEST_WORKERS ?= 5

.PHONY: demo test lint bench venv clean bytecode

venv: $(STAMP)

# The editable install in setuptools' "compat" mode: a path in a .pth file, where the default mode's
# import hook (a module of its own, with pathlib and importlib.util) cost every interpreter the venv
# starts 16 ms of CPU at its start: the suite starts about 1,000 (fork servers' stand-ins, persisters).
$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q $(TORCH)
	$(BIN)/python -m pip install -q -e ".[dev,plot]" --config-settings editable_mode=compat
	echo "$(TORCH)" > $(STAMP)

# The toolkit's bytecode, compiled once before a run (into the __pycache__ folders git ignores).
# Where the environment says PYTHONDONTWRITEBYTECODE (this workplace's machines do), Python
# writes none itself, and every process compiled the modules it imports from their source: each
# rank, persister and launcher the suite starts (some 1,500) a few tenths of a second of CPU
# (BENCHMARKS.md, thirty-fifth session).  An editable install leaves them to the first import.
bytecode: $(STAMP)
	$(BIN)/python -m compileall -q -j0 resilient reference_trainer reshape examples benchmarks tests

demo: $(STAMP) bytecode
	$(BIN)/resilient demo --out runs/demo

# Python may write bytecode during the run (PYTHONDONTWRITEBYTECODE unset): pytest's cache of the
# plugins it rewrites (anyio, xdist, hypothesis), written by the controller before the workers
# start, which otherwise each rewrote them (tests/conftest.py writes the test modules' own).
test: $(STAMP) bytecode
	PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder) $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

bench: $(STAMP)
	$(BIN)/python benchmarks/checkpoint_save.py
	$(BIN)/python benchmarks/checkpoint_load.py

clean:
	rm -rf $(VENV) runs .pytest_cache
	find resilient reference_trainer reshape examples benchmarks tests -name __pycache__ -prune -exec rm -rf {} +
