"""Trains every strategy named on the command line in turn, as a user's script would, under
whatever launch started it (fork, forkserver, popen, torchrun, SLURM): for each, ``fit``
then ``validate`` and ``test`` with the same Trainer, then one line ``RESULT {json}`` from
global rank 0 with the weights' distance to one process trained on the same batches.

Run by ``tests/conformance/test_conf_launchers.py`` (and the CS336 cases);
``python every_launch_script.py DEVICES NODES NAME...``.
"""

from __future__ import annotations

import json
import os
import sys
import time

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import lightning_par  # noqa: F401  (registers the strategies)
from lightning_par.strategies.registry import spec

BATCH, LR = 4, 0.1
STEPS = int(os.environ.get("LIGHTNING_PAR_TEST_STEPS", "3"))
#: ``plain``; or the CS336 assignment 2 DDP tests' cases (``stanford-cs336/assignment2-
#: systems``, ``tests/common.py``): ``frozen`` (a bias and a whole parameter with
#: ``requires_grad=False``) or ``tied`` (two layers share one weight).
MODEL = os.environ.get("LIGHTNING_PAR_TEST_MODEL", "plain")
#: Options that make a row comparable with one process in three steps.
OPTIONS = {
    "gpipe": {"chunks": 2},
    "local_sgd": {"period": 1},  # averaging every step = synchronous SGD (plain SGD)
    "parameter_server": {"num_servers": 2},
    "async_sgd": {"num_servers": 2},
}
#: Rows that give one process's weights; the others must train and end cleanly.
NOT_EXACT = {"async_sgd"}
#: A rank sleeps this long in ``on_save_checkpoint`` (``LIGHTNING_PAR_TEST_SLOW_CHECKPOINT``).
SLOW = float(os.environ.get("LIGHTNING_PAR_TEST_SLOW_CHECKPOINT", "0"))


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(64, 8, generator=g), torch.randint(0, 4, (64,), generator=g))


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        # (four linear layers: a model-parallel split over up to 4 ranks, 2 nodes x 2 tasks)
        self.net = nn.Sequential(
            nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
            nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4),
        )  # fmt: skip
        if MODEL == "frozen":
            self.net[2].bias.requires_grad_(False)
            self.fixed = nn.Parameter(torch.tensor([2.0, 2.0]), requires_grad=False)
        elif MODEL == "tied":
            self.net[4].weight = self.net[2].weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def _evaluate(self, batch, name: str) -> None:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log(name, loss, sync_dist=True, batch_size=len(x))

    def validation_step(self, batch, batch_idx):
        self._evaluate(batch, "val_loss")

    def test_step(self, batch, batch_idx):
        self._evaluate(batch, "test_loss")

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=LR)

    def on_save_checkpoint(self, checkpoint) -> None:
        if SLOW and self.global_rank == 0:  # a slow disk, a first compile: rank 0 is late
            time.sleep(SLOW)


def one_process(world: int, shuffled: bool = False) -> dict[str, torch.Tensor]:
    """Plain SGD on the ``world`` ranks' batches of each step together (as Lightning's
    ``DistributedSampler`` deals them: shuffled with seed 0; ``world=1``: in order, unless
    ``shuffled``: one data-parallel replica of hybrid's grid still gets Lightning's sampler)."""
    model = Tiny()
    x, y = data().tensors
    order = [list(DistributedSampler(data(), world, r, seed=0)) for r in range(world)]
    if world == 1 and not shuffled:
        order = [list(range(len(x)))]
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    for step in range(STEPS):
        rows = [i for ranks in order for i in ranks[step * BATCH : (step + 1) * BATCH]]
        opt.zero_grad()
        nn.functional.cross_entropy(model(x[rows]), y[rows]).backward()
        opt.step()
    return model.state_dict()


def largest(difference: torch.Tensor) -> float:
    """The largest absolute entry (0 for the empty tensors a pipeline device keeps in place of
    the layers other devices hold)."""
    return difference.abs().max().item() if difference.numel() else 0.0


def run(name: str, devices: int, nodes: int) -> dict:
    strategy = spec(name).create(**OPTIONS.get(name, {}))
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=devices, num_nodes=nodes,
        max_steps=STEPS, limit_val_batches=2, limit_test_batches=2, logger=False,
        enable_checkpointing=bool(SLOW), enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=os.getcwd(),
    )  # fmt: skip
    model = Tiny()
    loader = DataLoader(data(), batch_size=BATCH, shuffle=False)
    trainer.fit(model, loader, loader)
    step = trainer.global_step
    grid = getattr(trainer.strategy, "grid", None)  # hybrid: dp replicas, each model-split
    if dist.is_initialized() and (grid is not None or not trainer.strategy.shards_data):
        weights = trainer.strategy.lightning_module_state_dict()  # every stage takes part
    else:
        weights = model.state_dict()  # data parallel, or rank 0's after a fork launch
    weights = {k: v.detach().clone() for k, v in weights.items()}
    servers = getattr(getattr(trainer.strategy, "servers", None), "started", [])
    fitted = {k: v.detach().clone() for k, v in model.state_dict().items()}  # (this rank's)
    val = trainer.validate(model, loader, verbose=False)[0]["val_loss"]
    test = trainer.test(model, loader, verbose=False)[0]["test_loss"]
    # Lightning's run_model_test: validate and test must leave the weights as fit left them
    after = model.state_dict()
    eval_changed = max(largest(after[k].float() - v.float()) for k, v in fitted.items())
    world = trainer.world_size
    if grid is not None:
        reference = one_process(grid.dp, shuffled=True)
    else:
        reference = one_process(world if trainer.strategy.shards_data else 1)
    diff = moved = None
    whole = set(weights) == set(reference) and all(
        weights[k].shape == reference[k].shape for k in reference
    )  # (model-split: the whole model on rank 0 only; tensor_parallel's rank 1 has slices)
    if whole:
        diff = max(largest(weights[k].float() - reference[k]) for k in reference)
        start = Tiny().state_dict()
        moved = max(largest(weights[k].float() - start[k]) for k in start)
    env = type(trainer.strategy.cluster_environment).__name__
    return {
        "strategy": name, "rank": trainer.global_rank, "world": world, "step": step,
        "steps": STEPS, "diff": diff, "moved": moved, "exact": name not in NOT_EXACT,
        "val": val, "test": test,
        "environment": env, "launch": getattr(trainer.strategy.launch_plan, "method", None),
        "servers_started": servers, "pid": os.getpid(), "eval_changed": eval_changed,
    }  # fmt: skip


def main() -> None:
    devices, nodes, names = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
    for name in names:
        result = run(name, devices, nodes)
        if dist.is_initialized():  # the next strategy builds its own group
            dist.destroy_process_group()
        # (one write per line: ranks share stdout)
        sys.stdout.write(f"RESULT {json.dumps(result)}\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
