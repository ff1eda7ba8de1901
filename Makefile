# Two commands do all set-up on a fresh machine (python3, pip and make only):
#   make demo   train the CIFAR CNN with a lightning_par strategy on 2 CPU processes, test it
#   make test   lint, every benchmark and strategy on the oldest torch we claim (a second
#               venv), unit and multi-process tests, every course notebook (nbval), the docs
#   make docs   the documentation site, into docs/_build/html (offline, warnings are errors)
# Each creates and fills the virtual environment .venv first.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch/torchvision come from this machine's local wheels; override on other machines,
# e.g. `make TORCH_PINS= test` to let pip pick any torch >= 2.4.
TORCH_PINS ?= torch==2.14.1 torchvision==0.29.1
# The oldest torch this machine's package index serves, in a second venv for the smoke run
# (`make smoke-old-torch`): torch 2.13.0's CPU file. Without torchvision: the index's 0.28.0
# is a CUDA build whose operators do not load beside a CPU torch (and a torchvision that
# fails to load stops even `import lightning`, through torchmetrics); without jupyter.
OLD_TORCH_PINS ?= torch==2.13.0+cpu
OLD_TORCH_LEAVE_OUT ?= torchvision jupyter
OLD_VENV ?= .venv-torch213
SMOKE_ARGS ?=

MODEL ?= CifarCNN
STRATEGY ?= ring_allreduce
DEVICES ?= 2
EPOCHS ?= 20
DATA ?= cifar10-mini
NB_TIMEOUT ?= 180
# Test files run two at a time (pytest-xdist, a file's tests on one worker, a notebook's cells
# in one kernel): run one at a time, the suite keeps about 0.4 of two cores busy, waiting on
# processes starting, heartbeats and sockets. More workers than cores slow the timing-bound
# tests (a frozen rank found within its limit), so raise it only with the cores.
TEST_WORKERS ?= 2

.PHONY: setup demo test lint check gpu-check bench clean docs browser userflow smoke-old-torch \
	old-torch-venv

setup: $(VENV)/.installed

# A path-based editable install (`editable_mode=compat`: a .pth line naming this folder) and
# not setuptools' default import hook: a script run from the folder that holds the checkout
# would otherwise import the checkout folder `lightning_par/` as an empty namespace package
# (Python's path finder answers before any import hook), and Lightning would reject every
# strategy name. `-qq` keeps pip to its errors: its warnings about a machine's own pip
# configuration are not the project's.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -qq $(TORCH_PINS) -e '.[dev]' --config-settings editable_mode=compat
	touch $@

demo: setup
	$(VENV)/bin/lightning-par fit --model=$(MODEL) --data.source=$(DATA) \
		--trainer.accelerator=cpu --trainer.devices=$(DEVICES) \
		--trainer.strategy=$(STRATEGY) --trainer.max_epochs=$(EPOCHS) \
		--trainer.default_root_dir=runs/demo

lint: setup
	$(VENV)/bin/ruff check lightning_par tests
	$(VENV)/bin/ruff format --check lightning_par tests

docs: setup
	$(VENV)/bin/sphinx-build -q -W --keep-going -b html docs docs/_build/html
	@echo "docs: open docs/_build/html/index.html"

# tests/test_docs_site.py opens the built course pages in headless Chromium: Debian's
# packages, installed when missing (CI runs as root on Debian; elsewhere install them).
browser:
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || { \
		command -v apt-get >/dev/null || { echo "install chromium and chromedriver"; exit 1; }; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
			apt-get install -y -qq --no-install-recommends chromium chromium-driver >/dev/null; }

# Every benchmark at its smallest and every strategy for two steps on OLD_TORCH_PINS
# (tests/smoke/run.py; the venv: about 100 s the first time, the run about 3 min on 2 cores).
$(OLD_VENV)/.installed: pyproject.toml tests/smoke/requirements.py
	$(PYTHON) -m venv $(OLD_VENV)
	$(PYTHON) -m tests.smoke.requirements --pin $(OLD_TORCH_PINS) \
		--leave-out $(OLD_TORCH_LEAVE_OUT) > $(OLD_VENV)/requirements.txt
	$(OLD_VENV)/bin/pip install -qq -r $(OLD_VENV)/requirements.txt
	$(OLD_VENV)/bin/pip install -qq --no-deps -e . --config-settings editable_mode=compat
	touch $@

old-torch-venv: $(OLD_VENV)/.installed

smoke-old-torch: $(OLD_VENV)/.installed
	$(OLD_VENV)/bin/python -m tests.smoke.run $(SMOKE_ARGS)

# (tests/test_old_torch_smoke.py runs the smoke, making the old venv if missing)
# The package and the tests' helpers are byte-compiled first: where Python may not write
# bytecode (PYTHONDONTWRITEBYTECODE=1 in the environment), every script, popen and
# torchrun rank would compile them again (about 0.6 s an interpreter, hundreds of them).
test: lint browser
	$(PY) -m compileall -q lightning_par tests >/dev/null
	$(VENV)/bin/pytest tests course --nbval-lax --nbval-current-env \
		--nbval-cell-timeout=$(NB_TIMEOUT) --durations=15 --junitxml=runs/test-times.xml \
		--numprocesses=$(TEST_WORKERS) --dist=loadfile

check: setup
	$(PY) -m lightning_par.check

# The user's whole flow (fit, save_checkpoint, validate, test, predict, load_from_checkpoint,
# resume) as a plain script for every strategy x network x launch (fork, popen, torchrun, a
# Jupyter kernel), each against one process: one Markdown table (about an hour on 2 cores;
# narrow it with USERFLOW_ARGS="--networks mlp --launches fork,popen"). CI runs a covering
# grid of it (tests/test_user_flow.py).
USERFLOW_ARGS ?=
userflow: setup
	$(PY) -m tests.userflow.grid $(USERFLOW_ARGS)

# On a machine with GPUs: the CUDA tests, every strategy on CifarCNN (NCCL; gloo where a
# plugin needs it) beside single-device Lightning, one table; then one training step through
# Lightning against a plain loop, profiled (`bench data`, benchmarks/data.md). Refused
# without CUDA; not part of `make test`.
gpu-check: setup
	$(PY) -m lightning_par.gpucheck --accelerator gpu
	$(PY) -m lightning_par.bench data --device cuda

clean:
	rm -rf $(VENV) $(OLD_VENV) runs lightning_logs .pytest_cache docs/_build docs/_generated \
		docs/reference/_autosummary docs/course docs/benchmarks docs/CONTRIBUTING.md
