"""Run by test_one_worker_failures as ``python _one_worker_failure_script.py KIND:WHERE ...``:
for each case one worker (devices=1) fails in the way it names, in this one interpreter; a
``CASE`` line says what it raised. Exit code 7 when every case raised (the test then finds
no process of the script's session left: a server a fit left would still be there)."""

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


def fail(kind: str, where: str) -> bool:
    """One fit that fails at ``where``; prints how it ended, and says whether it raised."""
    torch.manual_seed(0)
    model = MODELS[where](width=8, num_blocks=2, scheduler=None)
    model.global_batch = 8
    cls = ParameterServerStrategy if kind == "parameter_server" else AsyncSGDStrategy
    start = time.monotonic()
    try:
        fit(model, cls(num_servers=1), 1)
    except BaseException as err:
        said = f"raised after {time.monotonic() - start:.1f} s: {err}".replace("\n", " ")
    else:
        said = "no error"
    print(f"CASE {kind}:{where} {said}", flush=True)
    return said != "no error"


if __name__ == "__main__":
    # (one interpreter for every case: each fit starts and ends its own servers)
    print(f"pid {os.getpid()}", flush=True)
    raised = [fail(*case.split(":")) for case in sys.argv[1:]]
    sys.exit(7 if all(raised) else 0)
