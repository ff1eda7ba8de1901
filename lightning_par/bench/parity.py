"""Parity with raw torch DDP: every data-parallel plugin against ``DistributedDataParallel``.

    python -m lightning_par.bench parity --devices 2 --steps 120

After Lightning's Fabric parity test (``Lightning-AI/pytorch-lightning``,
``tests/tests_fabric/parity/test_parity_ddp.py`` and ``models.py``): a small ConvNet (two
5x5 convolutions with max-pooling, three linear layers, as in the PyTorch CIFAR tutorial)
on random 3x32x32 images, plain SGD, the same batches through a ``DistributedSampler``
without shuffling. In the same ranks, raw torch DDP (``torch.nn.parallel.
DistributedDataParallel`` on the default gloo group) trains first, then each plugin under a
Lightning ``Trainer`` from the same initial weights; the final state dicts are compared
(``tests/conformance/test_conf_ddp_parity.py`` asserts they agree) and the median step
times of rank 0 reported, with each plugin's ratio to torch DDP's (> 1: slower). Times are
reported, never asserted. The parameter servers build a process group of their own and
cannot join these ranks: their equivalence is ``tests/conformance/test_conf_cs336_ddp.py``.

The peers, torch DDP (on a gloo group of its own) and Lightning's DDP (``lightning_ddp``),
run guarded: one that fails is a row ``{"failed": ...}`` and the plugins are still trained
(:mod:`._peers`; without torch DDP's weights, their ``diff`` is ``None``).
"""

from __future__ import annotations

import argparse
import statistics
import time

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from typing_extensions import override

from lightning_par.bench._environment import RunEnvironment, print_result
from lightning_par.bench._peers import PeerGuard, run_with_peers
from lightning_par.strategies.registry import spec

#: Plugins that train inside ranks that exist (the torchrun path), with the options that
#: make them synchronous SGD.
PLUGINS: dict[str, dict] = {
    **{
        f"{a}_allreduce": {}
        for a in ("ring", "tree", "butterfly", "all_to_all", "master_worker", "round_robin")
    },  # fmt: skip
    "local_sgd": {"period": 1},
    "zero": {},  # stage 3: parameters, gradients and optimizer state sharded
    "lightning_ddp": {},
}
BATCH, LR = 4, 0.01
#: torch's DDP and Lightning's: guarded, their failures rows
TORCH_DDP, PEERS = "torch_ddp", ("torch_ddp", "lightning_ddp")


class ConvNet(nn.Module):
    """Two conv + pool blocks and three linear layers on 3x32x32 inputs (10 classes)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(3, 6, 5), nn.Conv2d(6, 16, 5)
        self.fc1, self.fc2, self.fc3 = nn.Linear(400, 120), nn.Linear(120, 84), nn.Linear(84, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(x.flatten(1)))
        return self.fc3(F.relu(self.fc2(x)))


class ParityModule(pl.LightningModule):
    def __init__(self, net: ConvNet) -> None:
        super().__init__()
        self.net = net

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    @override
    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    @override
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)


class _StepTimes(pl.Callback):
    def __init__(self) -> None:
        self.times: list[float] = []
        self._start = 0.0

    @override
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._start = time.perf_counter()

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.times.append(time.perf_counter() - self._start)


def initial_net() -> ConvNet:
    torch.manual_seed(42)
    return ConvNet()


def loader(rank: int, world: int, steps: int) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    n = steps * BATCH * world
    data = TensorDataset(
        torch.rand(n, 3, 32, 32, generator=g), torch.randint(0, 10, (n,), generator=g)
    )
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=False)
    return DataLoader(data, batch_size=BATCH, sampler=sampler)


def train_torch_ddp(
    rank: int, world: int, steps: int, group: dist.ProcessGroup | None = None
) -> tuple[dict, list[float]]:
    """Raw torch DDP over ``group`` (default: the existing default group): final state dict
    and step times."""
    net = initial_net()
    ddp = nn.parallel.DistributedDataParallel(net, process_group=group)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    times = []
    for x, y in loader(rank, world, steps):
        start = time.perf_counter()
        opt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        opt.step()
        times.append(time.perf_counter() - start)
    return {k: v.detach().clone() for k, v in net.state_dict().items()}, times


def train_plugin(name: str, rank: int, world: int, steps: int) -> tuple[dict, list[float]]:
    """The plugin ``name`` under a Trainer in the existing ranks, same start, same batches."""
    module, timer = ParityModule(initial_net()), _StepTimes()
    trainer = pl.Trainer(
        strategy=spec(name).create(**PLUGINS[name]), accelerator="cpu", devices=world,
        max_steps=steps, use_distributed_sampler=False, logger=False, callbacks=[timer],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, loader(rank, world, steps))
    return {k: v.detach().clone() for k, v in module.net.state_dict().items()}, timer.times


def parity(rank: int, world: int, names: list[str], steps: int, *,
           guard: PeerGuard | None = None) -> dict:  # fmt: skip
    """In one set of ranks: torch DDP, then each plugin; each run's largest weight
    difference to torch DDP's, its median step time (rank 0's), and whether it moved. The
    peers run through ``guard`` (none: a failure raises); one that failed has no row."""
    guard = guard or PeerGuard()
    group = guard.group(TORCH_DDP)
    ddp = guard.run(TORCH_DDP, lambda: train_torch_ddp(rank, world, steps, group))
    start = initial_net().state_dict()
    rows = {}
    if ddp is not None:
        reference, ddp_times = ddp
        rows[TORCH_DDP] = {"diff": 0.0, "step_ms": 1e3 * statistics.median(ddp_times[5:])}
    for name in names:
        train = lambda name=name: train_plugin(name, rank, world, steps)  # noqa: E731
        trained = guard.run(name, train) if name in PEERS else train()
        if trained is None:
            continue
        weights, times = trained
        diff = None if ddp is None else max((weights[k] - reference[k]).abs().max().item()
                                            for k in reference)  # fmt: skip
        rows[name] = {
            "diff": diff,
            "moved": max((weights[k] - start[k]).abs().max().item() for k in start),
            "steps": len(times),
            "step_ms": 1e3 * statistics.median(times[5:]),
        }
    if dist.is_initialized():
        dist.barrier()
    return rows


def report(result: dict) -> str:
    lines = [f"parity with torch DDP: {result['devices']} CPU processes, {result['steps']} "
             "steps, the same batches (diff: largest |w - w_torch_ddp|)",
             f"{'plugin':>24} {'step ms':>9} {'vs torch DDP':>13} {'diff':>10}"]  # fmt: skip
    for r in result["rows"]:
        if "failed" in r:
            lines.append(f"{r['plugin']:>24} failed: {r['failed']}")
            continue
        ratio, diff = r["ratio_to_torch_ddp"], r["diff"]
        lines.append(f"{r['plugin']:>24} {r['step_ms']:>9.1f} "
                     f"{'-' if ratio is None else f'{ratio:.3f}':>13} "
                     f"{'-' if diff is None else f'{diff:.1e}':>10}")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--plugins", nargs="*", default=list(PLUGINS), choices=list(PLUGINS))
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    args = parser.parse_args(argv)
    started = RunEnvironment.now()
    per_rank, failed = run_with_peers(parity, args.devices, args.plugins, args.steps,
                                      timeout=600)  # fmt: skip
    measured = per_rank[0]
    base = measured.get(TORCH_DDP, {}).get("step_ms")
    rows = [{"plugin": name, **row,
             "ratio_to_torch_ddp": None if base is None else row["step_ms"] / base}
            for name, row in measured.items()]  # fmt: skip
    rows += [{"plugin": name, "failed": error} for name, error in failed.items()]
    result = {"devices": args.devices, "steps": args.steps, "rows": rows}
    print_result(result, report, args.json, started)
    return 0
