"""The example models: splittable shapes, micro-batch invariance, training on 1 and 2 processes."""

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_par.data import CIFAR10DataModule
from lightning_par.models import CifarCNN, CifarRNN
from lightning_par.strategies import reference_ddp


def _tiny(kind: str, **kw):
    if kind == "cnn":
        return CifarCNN(width=8, num_blocks=2, **kw)
    return CifarRNN(hidden_size=16, num_layers=2, **kw)


@pytest.mark.parametrize("kind", ["cnn", "rnn"])
def test_net_is_a_splittable_chain(kind):
    model = _tiny(kind)
    assert isinstance(model.net, nn.Sequential)
    x = torch.randn(5, 3, 32, 32)
    # Running the chain element by element is the same as running the model.
    h = x
    for layer in model.net:
        h = layer(h)
    torch.testing.assert_close(h, model(x))
    assert h.shape == (5, 10)


def test_cnn_has_stem_blocks_and_head():
    assert len(CifarCNN(num_blocks=4).net) == 6
    assert len(CifarRNN(num_layers=3).net) == 5


@pytest.mark.parametrize("kind", ["cnn", "rnn"])
def test_micro_batches_give_the_whole_batch_result(kind):
    model = _tiny(kind).eval()
    x = torch.randn(8, 3, 32, 32)
    whole = model(x)
    parts = torch.cat([model(c) for c in x.split(3)])
    torch.testing.assert_close(whole, parts, rtol=1e-5, atol=1e-5)


def test_batchnorm_option_depends_on_the_batch():
    model = CifarCNN(width=8, num_blocks=2, norm="batch").train()
    x = torch.randn(8, 3, 32, 32)
    assert any(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    assert not torch.allclose(model(x), torch.cat([model(c) for c in x.split(4)]), atol=1e-4)


@pytest.mark.parametrize(
    "factory, message",
    [
        (lambda: CifarCNN(norm="layer"), "norm="),
        (lambda: CifarCNN(num_blocks=0), "num_blocks"),
        (lambda: CifarRNN(num_layers=0), "num_layers"),
        (lambda: CifarCNN(optimizer="lbfgs"), "optimizer="),
        (lambda: CifarCNN(scheduler="step"), "scheduler="),
        (lambda: CifarRNN(lr=0), "lr must be positive"),
    ],
)
def test_bad_model_options_fail_clearly(factory, message):
    with pytest.raises(ValueError, match=message):
        factory()


def _fit(model, devices: int, steps: int = 12):
    pl.seed_everything(0, verbose=False)
    data = CIFAR10DataModule(source="synthetic", batch_size=32, synthetic_size=512, augment=False)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=reference_ddp() if devices > 1 else "auto",
        max_steps=steps,
        limit_val_batches=2,
        val_check_interval=steps,
        check_val_every_n_epoch=None,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, datamodule=data)
    return trainer


@pytest.mark.parametrize("kind", ["cnn", "rnn"])
@pytest.mark.parametrize("devices", [1, 2])
def test_models_learn_on_one_and_two_processes(kind, devices):
    model = _tiny(kind, lr=0.01 if kind == "rnn" else 0.05, scheduler=None)
    trainer = _fit(model, devices, steps=25)
    metrics = trainer.callback_metrics
    assert metrics["train_loss"] < 2.0  # chance level is ln(10) = 2.30
    assert metrics["val_acc"] > 0.3  # chance level is 0.1


class _EpochAccuracy(pl.Callback):
    """The batches of each epoch, and the ``train_acc`` a callback sees at its end."""

    def __init__(self) -> None:
        self.batches: list[list] = []
        self.seen: list[float] = []

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self.batches.append([])

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.batches[-1].append([t.clone() for t in batch])

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self.seen.append(float(trainer.callback_metrics["train_acc"]))


def test_train_acc_is_each_epochs_own_accuracy_when_its_epoch_ends():
    # train_acc is only update()-d each step (its forward's batch value is never read):
    # Lightning must still compute it over all that epoch's batches, reset it for the next,
    # and show a callback at the epoch's end this epoch's value. A learning rate of ~0 keeps
    # the predictions of the end equal to those made during the epoch; two of six batches an
    # epoch, shuffled, give each epoch other images.
    torch.manual_seed(1)  # (an initial CifarCNN that predicts several classes)
    model = _tiny("cnn", lr=1e-12, scheduler=None)
    data = CIFAR10DataModule(source="synthetic", synthetic_size=96, val_size=0, batch_size=16,
                             augment=False)  # fmt: skip
    record = _EpochAccuracy()
    pl.Trainer(max_epochs=3, limit_train_batches=2, limit_val_batches=0, logger=False,
               enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
               callbacks=[record]).fit(model, datamodule=data)  # fmt: skip
    model.eval()
    with torch.no_grad():
        expected = [
            torch.cat([model(x).argmax(1) == y for x, y in epoch]).float().mean().item()
            for epoch in record.batches
        ]
    assert len(set(expected)) > 1, expected  # the epochs' images differ
    assert record.seen == pytest.approx(expected, abs=1e-6)
