"""Parameter server against ring allreduce and Lightning's DDP: step time and link bytes.

    python -m lightning_par.bench parameter_server [--rounds 3] [--steps 10] [--json]

W = 2 CPU workers train, on synthetic data, a wide MLP (4 x Linear(2048): communication
dominates) and the CIFAR CNN under ``parameter_server`` with S = 1 and 2 servers,
``ring_allreduce`` and ``lightning_ddp``. Each round runs every contender once per model
(interleaved, so a change in the shared machine's load hits all of them); a contender's
step time is the median start-to-start time of its steps after ``--warmup``, and its
figure the best over rounds (likewise the CPU worker 0's process used per step, which a
loaded machine disturbs far less). ``--strategies`` runs a subset (the ring always).
Bytes come from every worker's trace (``trace_dir``, in the first round only: the later
rounds run untraced, as Lightning's DDP does): per step, the traffic in and out
of the busiest process (a server, or a ring rank), against the cost model for one server,
``2·W·n`` (each of the W workers pushes n bytes of gradients to it and pulls n bytes of
weights back). Lightning's DDP is the peer: if a fit of it fails, its row says so
(``failed``) and the others are still timed (:mod:`._peers`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections import defaultdict
from functools import partial
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from typing_extensions import override

from lightning_par.bench._environment import RunEnvironment, print_result
from lightning_par.bench._peers import attempt
from lightning_par.comm.trace import load_traces
from lightning_par.models import CifarCNN
from lightning_par.strategies.allreduce import AllReduceStrategy
from lightning_par.strategies.parameter_server import ParameterServerStrategy

WORKERS = 2
#: Lightning's own: a failure is its row
PEER = "lightning_ddp"


class WideMLP(pl.LightningModule):
    """``layers`` x Linear(width, width) with ReLU, then a 10-way head; SGD with momentum."""

    def __init__(self, width: int = 2048, layers: int = 4, batch: int = 32, steps: int = 10):
        super().__init__()
        self.width, self.batch, self.steps = width, batch, steps
        body = [m for _ in range(layers) for m in (nn.Linear(width, width), nn.ReLU())]
        self.net = nn.Sequential(*body, nn.Linear(width, 10))

    @override
    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    @override
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    @override
    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        n = self.batch * self.steps
        data = TensorDataset(torch.randn(n, self.width, generator=g), torch.randint(0, 10, (n,)))
        return DataLoader(data, batch_size=self.batch)


class CNN(CifarCNN):
    def __init__(self, batch: int = 32, steps: int = 10):
        super().__init__(width=16, num_blocks=2, scheduler=None)
        self.batch, self.steps = batch, steps

    @override
    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        n = self.batch * self.steps
        x, y = torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 10, (n,), generator=g)
        return DataLoader(TensorDataset(x, y), batch_size=self.batch)


class StepClock(pl.Callback):
    """Rank 0 writes the start time of every training step to ``path``, and the CPU time
    its process (all its threads) had used by then: on a shared machine the CPU a step
    costs varies far less with the load than its wall time."""

    def __init__(self, path: Path) -> None:
        self.path, self.starts, self.cpu = path, [], []

    @override
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.starts.append(time.perf_counter())
        self.cpu.append(time.process_time())

    @override
    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.is_global_zero:
            self.path.write_text(json.dumps({"starts": self.starts, "cpu": self.cpu}))


def contenders() -> dict:
    """Name -> strategy made from a trace directory (``None``: not traced)."""

    def ps(servers: int):
        return lambda d: ParameterServerStrategy(num_servers=servers, trace_dir=d)

    return {
        "parameter_server(S=1)": ps(1),
        "parameter_server(S=2)": ps(2),
        "ring_allreduce": lambda d: AllReduceStrategy("ring", trace_dir=d),
        "lightning_ddp": lambda d: "lightning_ddp",
    }


def busiest_bytes_per_step(trace_dir: Path, steps: int) -> float:
    """Bytes in and out of the busiest process per step, from every worker's trace: a
    server's traffic is what its workers sent it and received from it; with no server,
    each rank's own sends and receives (the one-time initial weights are left out)."""
    servers: dict[int, int] = defaultdict(int)
    ranks: dict[int, int] = defaultdict(int)
    for trace in load_traces(trace_dir):
        for m in trace.messages:
            if m.tag == "init":
                continue
            ranks[m.rank] += m.nbytes
            if m.peer >= WORKERS:
                servers[m.peer] += m.nbytes
    return max((servers or ranks).values()) / steps


def fit_once(
    name: str, make, model: pl.LightningModule, root: Path, steps: int, traced: bool = True
) -> dict:
    clock = root / "steps.json"
    trace_dir = root / "trace"
    trainer = pl.Trainer(
        strategy=make(str(trace_dir) if traced else None), accelerator="cpu", devices=WORKERS,
        max_steps=steps,
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, use_distributed_sampler=False,
        callbacks=[StepClock(clock)],
    )  # fmt: skip
    trainer.fit(model)
    clocks = json.loads(clock.read_text())
    link = busiest_bytes_per_step(trace_dir, steps) if trace_dir.exists() else None
    return {**clocks, "busiest_bytes_per_step": link}


def _peer_fit(fit, failed: dict[tuple[str, str], str], model_name: str) -> dict | None:
    """Lightning's DDP's fit, or ``None`` with its failure noted in ``failed``."""
    out, error = attempt(PEER, fit)
    if error is not None:
        failed[model_name, PEER] = error
    return out


def run(args) -> dict:
    models = {"wide_mlp": lambda: WideMLP(width=args.width, batch=args.batch, steps=args.steps),
              "cnn": lambda: CNN(batch=args.batch, steps=args.steps)}  # fmt: skip
    times: dict[tuple[str, str], list[float]] = defaultdict(list)
    cpu: dict[tuple[str, str], list[float]] = defaultdict(list)  # worker 0's process
    links: dict[tuple[str, str], float | None] = {}
    failed: dict[tuple[str, str], str] = {}  # the peer's failed fits
    nbytes = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for model_name, make_model in models.items():
                for name, make in contenders().items():
                    if name not in args.strategies or (model_name, name) in failed:
                        continue
                    root = Path(tmp) / f"{r}-{model_name}-{name}"
                    root.mkdir()
                    torch.manual_seed(0)
                    model = make_model()
                    nbytes[model_name] = sum(p.numel() * p.element_size()
                                             for p in model.parameters())  # fmt: skip
                    # Round 0 traces every message for the bytes; the later rounds run
                    # untraced, as Lightning's DDP always does and as users run ours.
                    fit = partial(fit_once, name, make, model, root, args.steps, r == 0)
                    if name != PEER:
                        out = fit()
                    elif (out := _peer_fit(fit, failed, model_name)) is None:
                        continue
                    for key, into in (("starts", times), ("cpu", cpu)):
                        deltas = [b - a for a, b in zip(out[key], out[key][1:])]
                        into[model_name, name].append(statistics.median(deltas[args.warmup :]))
                    if r == 0:
                        links[model_name, name] = out["busiest_bytes_per_step"]
    rows = [{"model": model_name, "strategy": name, "failed": error}
            for (model_name, name), error in failed.items()]  # fmt: skip
    for (model_name, name), rounds in times.items():
        if (model_name, name) in failed:  # (a peer that ran in one round, failed in another)
            continue
        ring = min(times[model_name, "ring_allreduce"])
        n = nbytes[model_name]
        link = links[model_name, name]
        rows.append({
            "model": model_name, "strategy": name, "step_s": min(rounds),
            "rounds_step_s": rounds, "vs_ring": min(rounds) / ring, "model_bytes": n,
            "worker0_cpu_step_s": min(cpu[model_name, name]),
            "cpu_vs_ring": min(cpu[model_name, name]) / min(cpu[model_name, "ring_allreduce"]),
            "busiest_link_bytes_per_step": link,
            "cost_model_one_server_bytes": 2 * WORKERS * n,
        })  # fmt: skip
    setup = {k: getattr(args, k) for k in ("rounds", "steps", "warmup", "batch", "width")}
    return {"workers": WORKERS, **setup, "rows": rows}


def report(result: dict) -> str:
    lines = [
        f"W = {result['workers']} CPU workers, batch {result['batch']}/worker, best of "
        f"{result['rounds']} interleaved rounds, median of steps after {result['warmup']}",
        "",
        "| model | strategy | step ms | vs ring | worker 0 CPU ms | vs ring "
        "| busiest link MB/step | 2·W·n MB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        if "failed" in r:
            lines.append(f"| {r['model']} | {r['strategy']} | failed: {r['failed']} |" + " |" * 5)
            continue
        link = r["busiest_link_bytes_per_step"]
        lines.append(
            f"| {r['model']} | {r['strategy']} | {r['step_s'] * 1e3:.1f} | {r['vs_ring']:.2f}x "
            f"| {r['worker0_cpu_step_s'] * 1e3:.1f} | {r['cpu_vs_ring']:.2f}x "
            f"| {'-' if link is None else f'{link / 1e6:.2f}'} "
            f"| {r['cost_model_one_server_bytes'] / 1e6:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_par.bench parameter_server")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10, help="steps per run")
    parser.add_argument("--warmup", type=int, default=3, help="steps not timed")
    parser.add_argument("--batch", type=int, default=32, help="per worker")
    parser.add_argument("--width", type=int, default=2048, help="the MLP's width")
    names = list(contenders())
    parser.add_argument(
        "--strategies", nargs="+", default=names, choices=names, metavar="NAME",
        help=f"contenders to run (default: all; ring_allreduce always): {', '.join(names)}",
    )  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    args = parser.parse_args(argv)
    if "ring_allreduce" not in args.strategies:
        args.strategies.append("ring_allreduce")  # every row's ratio is to the ring
    if args.rounds < 1 or args.steps < args.warmup + 2:
        parser.error("--rounds must be >= 1 and --steps >= --warmup + 2")
    started = RunEnvironment.now()
    result = run(args)
    print_result(result, report, args.json, started, indent=2)
    return 0
