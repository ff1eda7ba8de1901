# Two commands do all set-up on a fresh machine (python3, pip and make only):
#   make demo   train the CIFAR CNN with a lightning_par strategy on 2 CPU processes, test it
#   make test   lint, unit and multi-process tests, and every course notebook (nbval)
# Both create and fill the virtual environment .venv first.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch/torchvision come from this machine's local wheels; override on other machines,
# e.g. `make TORCH_PINS= test` to let pip pick any torch >= 2.4.
TORCH_PINS ?= torch==2.14.1 torchvision==0.29.1

MODEL ?= CifarCNN
STRATEGY ?= ring_allreduce
DEVICES ?= 2
EPOCHS ?= 20
DATA ?= cifar10-mini
NB_TIMEOUT ?= 180

.PHONY: setup demo test lint check gpu-check bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet $(TORCH_PINS) -e '.[dev]'
	touch $@

demo: setup
	$(VENV)/bin/lightning-par fit --model=$(MODEL) --data.source=$(DATA) \
		--trainer.accelerator=cpu --trainer.devices=$(DEVICES) \
		--trainer.strategy=$(STRATEGY) --trainer.max_epochs=$(EPOCHS) \
		--trainer.default_root_dir=runs/demo

lint: setup
	$(VENV)/bin/ruff check lightning_par tests
	$(VENV)/bin/ruff format --check lightning_par tests

test: lint
	$(VENV)/bin/pytest tests course --nbval-lax --nbval-current-env \
		--nbval-cell-timeout=$(NB_TIMEOUT) --durations=15

check: setup
	$(PY) -m lightning_par.check

# On a machine with GPUs: the CUDA tests, every strategy on CifarCNN (NCCL; gloo where a
# plugin needs it) beside single-device Lightning, one table. Refused without CUDA.
gpu-check: setup
	$(PY) -m lightning_par.gpucheck --accelerator gpu

clean:
	rm -rf $(VENV) runs lightning_logs .pytest_cache
