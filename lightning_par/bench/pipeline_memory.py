"""``python -m lightning_par.bench pipeline_memory [--model resnet18] [--stages 2,4] [--json]``:
what each pipeline device holds of a network no one here wrote, measured.

For each K, K processes each cut the network as ``gpipe`` does (by parameter count,
:mod:`lightning_par.graphcut`), keep their stages (:class:`~lightning_par.pipeline.network.
PipelinedNetwork` empties the rest), train one step with Adam, and report the bytes they
hold: parameters, gradients and optimiser state (Adam's two moments). The whole model in
one process is the reference row. JSON rows: ``name`` (``"<model> K=<k>"`` or ``"<model>
whole"``), ``stage``, ``param_bytes``, ``grad_bytes``, ``optimizer_bytes``.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torchvision.models import resnet18

from lightning_par.bench._environment import RunEnvironment, print_result
from lightning_par.comm import Communicator, run_on_ranks
from lightning_par.graphcut import split_module
from lightning_par.modelparallel.memory import stage_memory
from lightning_par.models.resnet import group_norm
from lightning_par.pipeline.network import PipelinedNetwork

MODELS = ("resnet18",)


def build(name: str) -> tuple[nn.Module, torch.Tensor]:
    """The network (same weights everywhere) and a batch of 4 CIFAR-sized images."""
    torch.manual_seed(0)
    model = resnet18(num_classes=10, norm_layer=group_norm)
    return model, torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(1))


def _one_step(model: nn.Module, x: torch.Tensor, network: PipelinedNetwork | None) -> dict:
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.numel()], lr=1e-3)
    if network is not None:
        network.active = True
    model(x).float().pow(2).mean().backward()
    if network is not None:
        network.backward()
    optimizer.step()
    return stage_memory(model, optimizer)


def _stage(rank: int, world: int, name: str) -> dict:
    model, x = build(name)
    split = split_module(model, (x[:2],), num_stages=world)
    network = PipelinedNetwork(model, split, Communicator(), chunks=2)
    return {**_one_step(model, x, network), "stage": rank}


def measure(name: str, stages: list[int]) -> list[dict]:
    model, x = build(name)
    rows = [{"name": f"{name} whole", "stage": 0, **_one_step(model, x, None)}]
    for k in stages:
        for row in run_on_ranks(_stage, k, name, timeout=300):
            rows.append({"name": f"{name} K={k}", **row})
    return rows


def report(rows: list[dict]) -> str:
    mib = 2**20
    lines = [
        "| run | stage | params | grads | Adam state | of the whole |",
        "|---|---|---|---|---|---|",
    ]
    whole = rows[0]["param_bytes"] + rows[0]["optimizer_bytes"]
    for r in rows:
        held = r["param_bytes"] + r["optimizer_bytes"]
        lines.append(
            f"| {r['name']} | {r['stage']} | {r['param_bytes'] / mib:.1f} MiB | "
            f"{r['grad_bytes'] / mib:.1f} MiB | {r['optimizer_bytes'] / mib:.1f} MiB | "
            f"{held / whole:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_par.bench pipeline_memory")
    parser.add_argument("--model", default="resnet18", choices=MODELS)
    parser.add_argument("--stages", default="2,4", help="comma list of device counts K")
    parser.add_argument("--json", action="store_true", help="print JSON rows")
    args = parser.parse_args(argv)
    stages = [int(k) for k in args.stages.split(",")]
    if any(k < 2 or k > 8 for k in stages):
        parser.error("--stages: each K between 2 and 8")
    started = RunEnvironment.now()
    rows = measure(args.model, stages)
    print_result({"rows": rows}, lambda r: report(r["rows"]), args.json, started, indent=2)
    return 0
