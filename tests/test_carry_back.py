"""What a fork launch brings back to the script (strategies/_carry_back.py): a result larger
than a pipe's buffer does not hang the launch, and the script goes on from rank 0's random
state as one process would."""

from __future__ import annotations

import pickle

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_par  # noqa: F401  (registers the strategy names)
from lightning_par.comm.trace import trace_to_dict
from lightning_par.strategies.registry import spec


class Draws(pl.LightningModule):
    """A linear model whose step draws from torch's generator (as dropout would)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))

    def training_step(self, batch, batch_idx):
        x, y = batch
        noise = torch.rand(()) * 0  # a draw that changes nothing but the generator
        return nn.functional.cross_entropy(self.net(x), y) + noise

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        data = TensorDataset(
            torch.randn(64, 4, generator=g), torch.randint(0, 2, (64,), generator=g)
        )
        return DataLoader(data, batch_size=8)


def _fit(strategy, devices: int, steps: int, tmp_path) -> pl.Trainer:
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=tmp_path)  # fmt: skip
    trainer.fit(Draws())
    return trainer


def test_the_script_goes_on_from_the_random_state_one_process_would_have(tmp_path):
    torch.manual_seed(5)
    _fit("auto", 1, 4, tmp_path / "one")
    after_one_process = torch.rand(3)
    torch.manual_seed(5)
    _fit(spec("gpipe").create(start_method="fork"), 2, 4, tmp_path / "gpipe")
    assert torch.equal(torch.rand(3), after_one_process)


def test_a_trace_larger_than_a_pipe_buffer_comes_back_without_hanging(tmp_path):
    # Lightning reads its result queue only once every rank has ended: a result past a
    # pipe's 64 KiB would block rank 0 in put() forever; the trace travels as a file
    strategy = spec("ring_allreduce").create(start_method="fork", trace=True)
    trainer = _fit(strategy, 2, 200, tmp_path)
    assert trainer.strategy.trace is not None
    assert len(pickle.dumps(trace_to_dict(trainer.strategy.trace))) > 64 * 1024
