"""torch's pipelining tests, written anew for this project's pipeline (after
``pytorch/pytorch``, ``test/distributed/pipelining/test_stage.py`` and ``model_registry.py``:
a multi-layer MLP and ``ExampleCode``, whose raw parameters go through ``torch.mm`` and whose
buffer is read on both sides of a cut, split across ranks and trained like one process;
``test_schedule.py``: every schedule's order checked by a validator before it runs, over a
grid of stages x micro-batches, and a wrong order refused).

Here the networks are held by a LightningModule and trained by ``GPipeStrategy`` under every
schedule it registers; the grid runs :func:`lightning_par.pipeline.validate.validate`.
"""

from __future__ import annotations

import itertools

import lightning.pytorch as pl
import pytest
import torch
from _any_models import RawParameters
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_par.comm import run_on_ranks
from lightning_par.pipeline.schedule import Step
from lightning_par.pipeline.schedules import SCHEDULES as REGISTRY
from lightning_par.pipeline.schedules import device_schedule
from lightning_par.pipeline.validate import ScheduleError, validate
from lightning_par.strategies.gpipe import GPipeStrategy

#: the schedules GPipeStrategy runs: stages dealt round-robin (ZBV's V is refused)
SCHEDULES = tuple(name for name, s in REGISTRY.items() if not s.v_shape)
BATCH, STEPS, WIDTH = 8, 2, 16


class Holder(pl.LightningModule):
    """An MLP of ``layers`` Linear+ReLU pairs (``MultiMLP``), or torch's ``ExampleCode``."""

    def __init__(self, name: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        if name == "mlp":
            pairs = [m for _ in range(4) for m in (nn.Linear(WIDTH, WIDTH), nn.ReLU())]
            self.model: nn.Module = nn.Sequential(*pairs)
        else:
            self.model = RawParameters(WIDTH)
        self.criterion = nn.MSELoss()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return self.criterion(self.model(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(5)
        x, y = (torch.randn(BATCH * STEPS, WIDTH, generator=g) for _ in range(2))
        return DataLoader(TensorDataset(x, y), batch_size=BATCH)


def _fit(strategy, devices: int, model: pl.LightningModule) -> pl.Trainer:
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=devices, max_steps=STEPS, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False, num_sanity_val_steps=0, limit_val_batches=0,
    )  # fmt: skip
    trainer.fit(model)
    return trainer


def _on_ranks(rank: int, world: int, cells: list[tuple[str, str, list[str] | None]]) -> list:
    out = []
    for name, schedule, points in cells:
        chunks = 2 * world if schedule == "interleaved" else 4  # a multiple of the devices
        strategy = GPipeStrategy(
            chunks=chunks, schedule=schedule, split_points=points, virtual_stages=2
        )
        model = Holder(name)
        trainer = _fit(strategy, world, model)
        state = trainer.strategy.lightning_module_state_dict()  # the whole network, rank 0
        out.append({k: v.detach().clone() for k, v in state.items()})
    return out


def _one_process(name: str) -> dict[str, torch.Tensor]:
    model = Holder(name)
    _fit("auto", 1, model)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize(
    "name, world, points",
    [("mlp", 2, None), ("example_code", 3, ["lin0", "lin1"])],
    ids=["multi_mlp-2", "example_code-3"],
)
def test_split_network_trains_like_one_process_under_every_schedule(name, world, points):
    # interleaved needs devices x 2 stages: the MLP's 8 layers cut automatically, torch's
    # ExampleCode has 3 stages only, so it runs the one-stage-per-device schedules
    schedules = SCHEDULES if name == "mlp" else ("gpipe", "1f1b", "zero_bubble")
    cells = [(name, s, points) for s in schedules]
    got = run_on_ranks(_on_ranks, world, cells, timeout=240)[0]
    expected = _one_process(name)
    for schedule, state in zip(schedules, got):
        assert state.keys() == expected.keys(), schedule
        for key, value in expected.items():  # the buffer too: it crossed every cut unchanged
            torch.testing.assert_close(state[key], value, rtol=1e-4, atol=1e-5,
                                       msg=f"{schedule}: {key}")  # fmt: skip


GRID = [
    (schedule, k, v, m)
    for schedule in SCHEDULES
    for k, v, m in itertools.product((1, 2, 3, 4), (1, 2, 3), (1, 2, 3, 4, 6, 8))
    if (v == 1 or schedule == "interleaved") and (schedule != "interleaved" or m % k == 0)
]


@pytest.mark.parametrize("schedule, devices, virtual, chunks", GRID)
def test_every_schedule_passes_the_validator_over_the_grid(schedule, devices, virtual, chunks):
    steps = device_schedule(schedule, devices, chunks, virtual)
    timed = validate(steps, devices * virtual, chunks)
    ops = {"gpipe": 2, "1f1b": 2, "interleaved": 2, "zero_bubble": 3}[schedule]
    assert len(timed) == ops * devices * virtual * chunks  # every step ran, none twice


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_wrong_order_is_refused_naming_the_step(schedule):
    steps = [
        list(s) for s in device_schedule(schedule, 2, 4, 2 if schedule == "interleaved" else 1)
    ]
    last = steps[-1]
    first_bwd = next(i for i, s in enumerate(last) if s.op != "fwd")
    # the last device runs a backward before the forward it belongs to
    moved = last.pop(first_bwd)
    last.insert(0, moved)
    with pytest.raises(ScheduleError, match=f"micro-batch {moved.micro_batch}"):
        validate(steps)
    assert isinstance(moved, Step)
