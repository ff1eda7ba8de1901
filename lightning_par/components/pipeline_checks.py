"""Checks behind :class:`~lightning_par.strategies.gpipe.GPipeStrategy`: settings, network,
balance, loss and backend, each rejected with what is wrong and how to fix it, before any
process starts where possible. Plain functions of the strategy's settings, so the strategy
file keeps only Lightning's hooks."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

from lightning_par.components.pipeline_loss import check_loss
from lightning_par.pipeline import CHECKPOINT_MODES, balance_by_params
from lightning_par.pipeline.partition import balance_by_time, check_balance, split_sequential
from lightning_par.pipeline.schedules import SCHEDULES, Schedule, get_schedule


def strategy_schedule(schedule: str | Schedule) -> Schedule:
    """The strategies' ``schedule``, looked up once (in the constructor): one whose stages
    are dealt round-robin over the ranks, as the strategies place them."""
    try:
        found = get_schedule(schedule)
    except ValueError:  # the names a strategy runs, in the form of its other options' errors
        choices = tuple(name for name, s in SCHEDULES.items() if not s.v_shape)
        raise ValueError(f"schedule={schedule!r}: choose one of {choices}") from None
    if found.v_shape:
        raise ValueError(
            f"GPipeStrategy does not run schedule={found.name!r}: its V-shaped stage layout "
            "(device d holds stages d and 2K-1-d) is not the strategies' round-robin one; use "
            "schedule='zero_bubble' (ZB-H1), or run ZBV with pipeline.step.scheduled_step"
        )
    return found


def check_settings(
    balance: list[int] | None, chunks: int, checkpoint: str, balance_by: str
) -> None:
    """Reject constructor arguments out of range (called by ``PipelineOptions``)."""
    if not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks (micro-batches per batch) must be an int >= 1: {chunks!r}")
    for name, value, choices in [
        ("checkpoint", checkpoint, CHECKPOINT_MODES),
        ("balance_by", balance_by, ("params", "time")),
    ]:
        if value not in choices:
            raise ValueError(f"{name}={value!r}: choose one of {choices}")
    if balance is not None:
        check_balance(sum(balance) if all(isinstance(b, int) for b in balance) else 0, balance)


def check_split_points(balance: list[int] | None, split_points: Any) -> None:
    """``split_points``: a list of module names, not given together with ``balance``."""
    if split_points is None:
        return
    if balance is not None:
        raise ValueError("give balance (layers of an nn.Sequential per stage) or "
                         "split_points (module names), not both")  # fmt: skip
    if isinstance(split_points, str) or not all(isinstance(p, str) for p in split_points):
        raise TypeError(f"split_points must be a list of module names: {split_points!r}")


def check_before_launch(
    module: pl.LightningModule | None,
    trainer: pl.Trainer | None,
    *,
    module_attr: str,
    stages: int,
    balance: list[int] | None,
    balance_by: str,
    schedule: Schedule,
    loss_attr: str,
    devices: Sequence[torch.device],
    backend: str | None,
    virtual_stages: int = 1,
    loss_fn: Callable | None = None,
    who: str = "gpipe",
) -> None:
    """Reject a network, balance or loss the strategy cannot run; nothing to check when there
    is no module yet. ``stages``: number of processes."""
    if module is None:
        return
    net = getattr(module, module_attr, None)
    if not isinstance(net, nn.Sequential):
        found = "nothing" if net is None else type(net).__name__
        raise TypeError(
            f"GPipeStrategy splits `{type(module).__name__}.{module_attr}` into stages, "
            f"which must be an nn.Sequential, but found {found}. Build the network as an "
            "nn.Sequential of layers (each mapping one tensor to one tensor), or pass "
            "module_attr='<name of your Sequential>'"
        )
    stages *= virtual_stages  # interleaved: several stages per device
    if stages > len(net):
        devices = stages // virtual_stages
        what, fix = f"{stages} devices (stages)", f"use devices <= {len(net)}"
        if virtual_stages > 1:
            what = f"{stages} stages ({devices} devices x {virtual_stages} virtual stages)"
            fix = f"use devices x virtual_stages <= {len(net)}"
        raise ValueError(f"{what} but `{module_attr}` has only {len(net)} layers: {fix}")
    if balance is not None:
        check_balance(len(net), balance, stages)
    balance = balance or (balance_by_params(net, stages) if balance_by == "params" else None)
    fitting = trainer is None or trainer.state.fn == "fit"
    if balance and fitting:
        check_stages_have_parameters(net, balance)
    if devices and devices[0].type == "cuda":
        check_backend(schedule, backend or "nccl")
    if schedule.loss_per_micro_batch:
        check_1f1b_loss(module, loss_attr, schedule, loss_fn, who)


def check_stages_have_parameters(net: nn.Sequential, balance: list[int]) -> None:
    """Every stage needs a parameter: its optimiser is built from its stage only. (Frozen
    ones count: an optimiser may hold a layer unfrozen later; one built from trainable
    parameters only fails at setup, see ``GPipeStrategy.setup_optimizers``.)"""
    for s, stage in enumerate(split_sequential(net, balance)):
        if not any(True for _ in stage.parameters()):
            layers = ", ".join(type(m).__name__ for m in stage)
            raise ValueError(
                f"stage {s} of balance {balance} ({layers}) "
                "has no parameters to train and torch optimisers reject an empty parameter "
                "list: give every stage a layer with parameters (balance=[...]) or use fewer "
                "devices"
            )


def check_1f1b_loss(
    module: pl.LightningModule,
    loss_attr: str,
    schedule: Schedule,
    loss_fn: Callable | None = None,
    who: str = "gpipe",
) -> None:
    """1F1B (and every schedule past it) calls the loss per micro-batch (``loss_fn``, else
    ``module.<loss_attr>``), which sums to the batch loss only for a mean
    (:mod:`~lightning_par.components.pipeline_loss`)."""
    check_loss(who, schedule, module, loss_fn, loss_attr)


def check_backend(schedule: Schedule, backend: str) -> None:
    """Reject 1F1B and the schedules past it on NCCL, which would deadlock."""
    if schedule.sends_both_ways and backend == "nccl":
        # 1F1B has a stage send its next activation while its neighbour sends a gradient
        # back; NCCL runs one pair's messages in posting order on one stream, so both
        # sends would wait for receives queued behind them.
        raise ValueError(
            f"schedule={schedule.name!r} needs sends in both directions between two stages at "
            "once, which NCCL point-to-point serialises (deadlock): use schedule='gpipe' on GPUs, "
            "or process_group_backend='gloo' (CUDA tensors are staged through host memory)"
        )


def check_trainer(trainer: pl.Trainer, schedule: Schedule, precision_plugin: Any) -> None:
    """Reject trainer settings that would differ from single-process training: a gradient
    scaler under 1F1B. (Clipping by norm uses the whole model's norm:
    :mod:`lightning_par.components.pipeline_features`.)"""
    if schedule.loss_per_micro_batch:
        check_1f1b_contract(precision_plugin, schedule)


def check_1f1b_contract(precision_plugin: Any, schedule: Schedule) -> None:
    """1F1B runs its backwards inside the training step, outside Lightning's loss scaling."""
    if getattr(precision_plugin, "scaler", None) is not None:
        raise ValueError(
            f"schedule={schedule.name!r} does not support a gradient scaler; use 'gpipe'"
        )


def resolve_balance(
    module: pl.LightningModule,
    net: nn.Sequential,
    *,
    stages: int,
    balance: list[int] | None,
    balance_by: str,
    rank: int,
    broadcast: Callable[[Any], Any],
) -> list[int]:
    """Layers per stage: the given ``balance``, else by parameter count, else timed on rank 0
    with ``module.example_input_array`` and ``broadcast`` so that every stage cuts alike."""
    if balance is not None:
        return list(balance)
    if balance_by == "params":
        return balance_by_params(net, stages)
    sample = getattr(module, "example_input_array", None)
    if not isinstance(sample, torch.Tensor):
        raise ValueError(
            "balance_by='time' measures each layer on `module.example_input_array`: set "
            "it to an input batch, or use balance_by='params' or an explicit balance"
        )
    return broadcast(balance_by_time(net, sample) if rank == 0 else None)
