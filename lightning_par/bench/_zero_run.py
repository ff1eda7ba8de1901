"""One rank of ``bench zero``: the models, the contenders and what is measured in each fit.

Every contender trains the same model (same initial weights, same batches) under a
Lightning ``Trainer`` in the ranks that ``run_on_ranks`` started, so each pays the same
Lightning overhead per step: ``ring_allreduce``, ``zero`` at each stage, and torch's
``fully_shard`` (FSDP2) through Lightning's ``ModelParallelStrategy`` on a device mesh
over the same ranks (gloo), wrapping every module with parameters of its own, as stage 3
makes one unit per such module. :class:`Probe` records, per step, the wall time and the
bytes and messages the trace gained; in the last step (left out of the times) the bytes
held by category after backward (:func:`held_now`) and the peak of live tensor storage
(:class:`~lightning_par.bench._live_bytes.LiveStorages`).
"""

from __future__ import annotations

import gc
import time
from dataclasses import replace
from functools import partial
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from typing_extensions import override

from lightning_par.bench._live_bytes import LiveStorages, storage_bytes
from lightning_par.bench._peers import PeerGuard
from lightning_par.models import CifarCNN
from lightning_par.models.classifier import ImageClassifier
from lightning_par.strategies.allreduce import AllReduceStrategy
from lightning_par.strategies.zero import ZeroStrategy
from lightning_par.zero.cost import Held, layout, resident_of, sizes_of

try:  # torch >= 2.6 (FSDP2)
    from torch.distributed.fsdp import fully_shard
except ImportError:  # pragma: no cover - older torch
    fully_shard = None

LR = 1e-3
#: torch's own contender (through Lightning's ModelParallelStrategy): a failure is its row
PEER = "fully_shard"


class WideMLP(ImageClassifier):
    """``depth`` square layers of ``width`` on ``width``-vectors, then 10 classes: a model
    whose parameters and Adam's state outweigh its activations many times."""

    def __init__(self, width: int = 768, depth: int = 4, optimizer: str = "adam", lr: float = LR,
                 weight_decay: float = 0.0, scheduler: str | None = None) -> None:  # fmt: skip
        super().__init__(10, optimizer, lr, 0.9, weight_decay, scheduler)
        self.save_hyperparameters()
        layers: list[nn.Module] = []
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.ReLU()]
        self.net = nn.Sequential(*layers, nn.Linear(width, 10))


class _FullyShard:
    """``configure_model`` for Lightning's ``ModelParallelStrategy``: ``fully_shard`` on
    every module of ``net`` with parameters of its own, children first, then on ``net``."""

    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]
        for module in reversed(list(self.net.modules())):
            if module is not self.net and next(module.parameters(recurse=False), None) is not None:
                fully_shard(module, mesh=mesh)
        fully_shard(self.net, mesh=mesh)


class ShardedMLP(_FullyShard, WideMLP):
    pass


class ShardedCNN(_FullyShard, CifarCNN):
    pass


def make_model(kind: str, options: dict, sharded: bool) -> pl.LightningModule:
    torch.manual_seed(0)
    if kind == "mlp":
        return (ShardedMLP if sharded else WideMLP)(options["mlp_width"], options["mlp_depth"])
    cls = ShardedCNN if sharded else CifarCNN
    return cls(width=options["cnn_width"], num_blocks=options["cnn_blocks"], optimizer="adam",
               lr=LR, scheduler=None)  # fmt: skip


def make_data(kind: str, options: dict, rank: int, steps: int) -> TensorDataset:
    g = torch.Generator().manual_seed(1000 + rank)
    n = options["batch_size"] * steps
    shape = (options["mlp_width"],) if kind == "mlp" else (3, 32, 32)
    return TensorDataset(
        torch.randn(n, *shape, generator=g), torch.randint(0, 10, (n,), generator=g)
    )


def make_strategy(name: str, options: dict, world: int):
    if name == "ring_allreduce":
        return AllReduceStrategy("ring", bucket_cap_mb=options["bucket_cap_mb"], trace=True)
    if name.startswith("zero"):
        return ZeroStrategy(stage=int(name[-1]), bucket_cap_mb=options["bucket_cap_mb"], trace=True)
    if fully_shard is None:
        raise RuntimeError(f"torch {torch.__version__} has no torch.distributed.fsdp.fully_shard")
    from lightning.pytorch.strategies import ModelParallelStrategy

    # every rank one data-parallel shard ("auto" would give the ranks to tensor parallelism)
    return ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)


def _params_and_state(trainer: pl.Trainer, module: nn.Module) -> tuple[list, list]:
    """The model's parameters and the optimizer's (zero's pieces, views of its shards);
    the optimizer's state tensors."""
    groups = [q for opt in trainer.optimizers for g in opt.param_groups for q in g["params"]]
    state = [v for opt in trainer.optimizers for s in opt.state.values() for v in s.values()]
    return [*module.parameters(), *groups], [v for v in state if isinstance(v, torch.Tensor)]


def held_now(trainer: pl.Trainer, module: nn.Module) -> Held:
    """Bytes held now, counted from the live tensors (distinct storages, current sizes):
    parameters, their gradients, the optimizer's state, and the gradient buckets kept
    between steps."""
    params, state = _params_and_state(trainer, module)
    strategy = trainer.strategy
    sync = getattr(strategy, "grad_sync", None) or getattr(
        getattr(strategy, "splitter", None), "grad_sync", None
    )
    buckets = sync.buckets.buckets if sync is not None and sync.buckets is not None else []
    return Held(
        storage_bytes(params),
        storage_bytes(q.grad for q in params),
        storage_bytes(state),
        storage_bytes(b.buffer for b in buckets),
    )


class Probe(pl.Callback):
    """Per step: wall time, bytes and messages sent (from the strategy's trace, if any);
    in step ``measure_at``: bytes held after backward and the peak of live storage."""

    def __init__(self, measure_at: int, exclude: list[torch.Tensor]) -> None:
        self.measure_at, self.exclude = measure_at, exclude
        self.times: list[float] = []
        self.sent: list[tuple[int, int]] = []
        self.held: Held | None = None
        self.peak = 0
        self._live: LiveStorages | None = None
        self._start = 0.0
        self._mark = 0

    @override
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        trace = getattr(trainer.strategy, "trace", None)
        self._mark = len(trace.messages) if trace is not None else 0
        if batch_idx == self.measure_at:
            gc.collect()
            self._live = LiveStorages(exclude=self.exclude)
            self._live.__enter__()
            params, state = _params_and_state(trainer, pl_module)  # (C++ may hold the grads)
            self._live.add(*params, *(q.grad for q in params), *state)
        self._start = time.perf_counter()

    @override
    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self._live is not None:
            self.held = held_now(trainer, pl_module)

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.times.append(time.perf_counter() - self._start)
        if self._live is not None:
            self._live.__exit__(None, None, None)
            self.peak, self._live = self._live.peak, None
        trace = getattr(trainer.strategy, "trace", None)
        sends = [m for m in trace.messages[self._mark :] if m.op == "send"] if trace else []
        self.sent.append((sum(m.nbytes for m in sends), len(sends)))


class _LayoutProbe(pl.Callback):
    """The cost model's :class:`~lightning_par.zero.cost.Layout` of the live units, read at
    the end of the first step (stage 3 knows its resident units by then)."""

    plan = None

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.plan is not None:
            return
        splitter = trainer.strategy.splitter
        base = layout(pl_module, splitter.stage, splitter.bucket_cap_mb)
        resident = frozenset()
        if splitter.stage3 is not None:
            resident = resident_of(splitter.units, splitter.stage3.resident)
        self.plan = replace(base, units=sizes_of(splitter.units), resident=resident)


def fit_one(kind: str, name: str, options: dict, rank: int, world: int) -> dict:
    """One contender's fit in this rank: what :class:`Probe` saw, and the cost model's
    layout of the live units (``zero``) or of the model (``ring_allreduce``)."""
    steps = options["warmup"] + options["steps"] + 1
    model = make_model(kind, options, sharded=name == "fully_shard")
    data = make_data(kind, options, rank, steps)
    probe = Probe(steps - 1, exclude=list(data.tensors))
    trainer = pl.Trainer(
        strategy=make_strategy(name, options, world), accelerator="cpu", devices=world,
        max_steps=steps, use_distributed_sampler=False, logger=False, callbacks=[probe],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, num_sanity_val_steps=0,
    )  # fmt: skip
    plan = None
    if name == "ring_allreduce":
        plan = layout(model, 0, options["bucket_cap_mb"])
    elif name.startswith("zero"):
        probe_plan = _LayoutProbe()
        trainer.callbacks.append(probe_plan)
    trainer.fit(model, DataLoader(data, batch_size=options["batch_size"]))
    if name.startswith("zero"):
        plan = probe_plan.plan
    psi = sum(q.numel() for q in model.parameters() if q.requires_grad)
    return {"times": probe.times[options["warmup"] : -1], "sent": probe.sent, "held": probe.held,
            "peak": probe.peak, "plan": plan, "psi": psi}  # fmt: skip


def measure(rank: int, world: int, models: list[str], contenders: list[str], options: dict,
            rounds: int, *, guard: PeerGuard) -> dict:  # fmt: skip
    """Every (model, contender) fit, ``rounds`` times in alternating order. torch's
    ``fully_shard`` is the peer: it runs through ``guard`` (its failure, under the key
    ``"<model>/fully_shard"``, is in ``guard.failed`` and it has no entry here); a failure of
    ours raises."""
    out: dict[str, dict[str, Any]] = {}
    for kind in models:
        for round_ in range(rounds):
            order = contenders if round_ % 2 == 0 else contenders[::-1]
            for name in order:
                key = f"{kind}/{name}"
                fit = partial(fit_one, kind, name, options, rank, world)
                result = guard.run(key, fit) if name == PEER else fit()
                if result is None:
                    continue  # the peer failed (in this round or an earlier one)
                if key in out:  # later rounds add their times
                    out[key]["times"] += result["times"]
                else:
                    out[key] = result
    for key in guard.failed:  # (a peer that ran in one round and failed in another)
        out.pop(key, None)
    return out
