"""Run by test_one_worker_failures: one worker (devices=1) fails in the way argv names."""

from __future__ import annotations

import os
import sys
import time

import torch
from test_parameter_server import CNN, fit

from lightning_par.strategies.async_sgd import AsyncSGDStrategy
from lightning_par.strategies.parameter_server import ParameterServerStrategy


class RaisesInStep(CNN):
    def training_step(self, batch, batch_idx):
        raise ValueError("boom in training_step")


class InterruptedInStep(CNN):
    def training_step(self, batch, batch_idx):
        raise KeyboardInterrupt


class LBFGSAtSetup(CNN):
    def configure_optimizers(self):
        return torch.optim.LBFGS(self.parameters())


MODELS = {"step": RaisesInStep, "interrupt": InterruptedInStep, "setup": LBFGSAtSetup}

if __name__ == "__main__":
    kind, where = sys.argv[1], sys.argv[2]
    print(f"pid {os.getpid()}", flush=True)
    torch.manual_seed(0)
    model = MODELS[where](width=8, num_blocks=2, scheduler=None)
    model.global_batch = 8
    cls = ParameterServerStrategy if kind == "parameter_server" else AsyncSGDStrategy
    start = time.monotonic()
    try:
        fit(model, cls(num_servers=1), 1)
    except BaseException as err:
        print(f"raised after {time.monotonic() - start:.1f} s: {err}", flush=True)
        sys.exit(7)
    print("no error", flush=True)
