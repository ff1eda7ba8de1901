"""The private names of Lightning's loops that lightning_par/_compat/loops.py uses still
exist and still do what lightning_par relies on: the epoch loop's SIGTERM broadcast, the
fit loop's combined loader and ``setup_data``, the first batch of the running stage and the
barrier around ``prepare_data``. (The other private names: ``test_compat.py``.)"""

from __future__ import annotations

import inspect

import lightning.pytorch as pl
import torch
from test_compat import _trainer

from lightning_par import _compat


def test_lightning_loop_names() -> None:
    from lightning.pytorch.loops import training_epoch_loop

    trainer = _trainer(max_steps=1)
    # the loop's only collective is the SIGTERM broadcast we replace (lightning >= 2.5.1),
    # or it has none (2.5.0)
    loop_cls = training_epoch_loop._TrainingEpochLoop
    source = inspect.getsource(loop_cls)
    called = []
    _compat.replace_sigterm_broadcast(trainer, lambda: called.append(1))
    if hasattr(loop_cls, "_broadcast_sigterm_tensor"):
        assert "self._broadcast_sigterm_tensor()" in source
        assert source.count("broadcast(") == 1  # inside the method we replace
        trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor()
        assert called == [1]
    else:
        assert not _compat.epoch_loop_broadcasts(loop_cls)
    assert _compat.num_ready_batches_reached(trainer) in (True, False)
    assert "self._combined_loader" in inspect.getsource(type(trainer.fit_loop))
    _compat.reset_combined_loader(trainer.fit_loop)
    assert trainer.fit_loop._combined_loader is None


def test_first_batch_is_the_first_batch_of_the_running_stage() -> None:
    from lightning.pytorch.demos.boring_classes import BoringModel

    seen = []

    class Peek(BoringModel):
        def train_dataloader(self):
            return torch.utils.data.DataLoader(torch.arange(64.0).view(2, 32), batch_size=1)

        def on_fit_start(self) -> None:
            seen.append(_compat.first_batch(self.trainer))

    model = Peek()
    pl.Trainer(max_steps=1, logger=False, enable_checkpointing=False,
               enable_progress_bar=False, enable_model_summary=False).fit(model)  # fmt: skip
    assert torch.equal(seen[0], torch.arange(32.0).view(1, 32))


def test_barrier_around_prepare_data_is_used() -> None:
    from lightning.pytorch.trainer.connectors import data_connector

    entered = []

    class Barrier:
        def __enter__(self):
            entered.append("in")

        def __exit__(self, *exc):
            entered.append("out")

    class Module(pl.LightningModule):
        def prepare_data(self) -> None:
            entered.append("prepare")

    trainer = _trainer()
    trainer.strategy.connect(Module())
    trainer.strategy._lightning_module._trainer = trainer
    original = data_connector._InfiniteBarrier
    _compat.barrier_around_prepare_data(trainer, Barrier)
    trainer._data_connector.prepare_data()
    assert entered == ["in", "prepare", "out"]
    assert data_connector._InfiniteBarrier is original


def test_wrapped_setup_data_runs_after_lightnings() -> None:
    trainer = _trainer()
    loop = trainer.fit_loop
    calls = []
    original = loop.setup_data
    loop.setup_data = lambda: calls.append("lightning")
    _compat.wrap_setup_data(loop, lambda: calls.append("after"))
    loop.setup_data()
    assert calls == ["lightning", "after"]
    loop.setup_data = original
    assert "self.setup_data()" in inspect.getsource(type(loop).run)  # the loop calls it
