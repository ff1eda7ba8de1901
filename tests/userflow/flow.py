"""A user's plain script, the whole flow of Lightning's docs, on a network no one here wrote.

    python flow.py STRATEGY NETWORK OUT_DIR [--devices N] [--start-method M] [--batch B]
    python flow.py one NETWORK OUT_DIR --batch B [--replicas P]

fit (1 epoch) -> save_checkpoint -> validate -> test -> predict -> load_from_checkpoint ->
a new Trainer's fit to 2 epochs from the checkpoint. Lightning picks the launcher from the
strategy; nothing here sets what a real launcher would not. Rank 0 (the process the script
goes on in) writes ``OUT_DIR/result.pt``: every figure, for the test to compare with the
same script on one process (``STRATEGY`` = ``one``), and how the launch went (the cluster
environment Lightning detected, the start method); any other rank that runs the script
(popen, torchrun) writes ``OUT_DIR/result-rank<N>.pt``, so the test sees it reach the end
too. A step that raises is recorded with the error's type and message and ends the flow.
"""

from __future__ import annotations

import argparse
import os
import time
import traceback

import lightning.pytorch as pl
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import lightning_par  # noqa: F401  (registers the strategy names)

SAMPLES = 64


def build(network: str) -> nn.Module:
    """A network as its authors ship it, seeded so every run builds the same one."""
    torch.manual_seed(0)
    if network == "mlp":
        from torchvision.ops import MLP

        return MLP(16, [32, 32, 4])
    if network == "resnet":
        from torchvision.models import resnet18

        return resnet18(num_classes=4, norm_layer=lambda c: nn.GroupNorm(4, c))
    if network == "vit":
        from torchvision.models import VisionTransformer

        return VisionTransformer(image_size=16, patch_size=8, num_layers=2, num_heads=2,
                                 hidden_dim=16, mlp_dim=32, num_classes=4, dropout=0.0)  # fmt: skip
    if network == "lstm":
        from lightning.pytorch.demos import SimpleLSTM

        return SimpleLSTM(vocab_size=12, ninp=8, nhid=16, nlayers=2, dropout=0.0)
    if network == "transformer":
        from lightning.pytorch.demos import Transformer

        return Transformer(vocab_size=12, ninp=16, nhead=2, nhid=16, nlayers=2, dropout=0.0)
    raise SystemExit(f"unknown network {network!r}")


class Samples(Dataset):
    """Fixed synthetic samples ``(index, x, y)`` shaped for ``network``."""

    def __init__(self, network: str) -> None:
        g = torch.Generator().manual_seed(1)
        if network in ("lstm", "transformer"):
            self.x = torch.randint(0, 12, (SAMPLES, 6), generator=g)
            self.y = torch.randint(0, 12, (SAMPLES, 6), generator=g)
        else:
            shape = (16,) if network == "mlp" else (3, 16, 16)
            self.x = torch.randn(SAMPLES, *shape, generator=g)
            self.y = torch.randint(0, 4, (SAMPLES,), generator=g)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int):
        return i, self.x[i], self.y[i]


class _Epoch:
    """Where Lightning's loop sets the epoch (``batch_sampler.sampler.set_epoch``)."""

    epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch


class AsReplicas:
    """One process reading, as one batch, the batches that ``replicas`` ranks read at each
    step through the ``DistributedSampler`` Lightning gives a data-parallel run (shuffled,
    seeded by ``seed_everything`` or 0, a new order each epoch): the one-process run a
    data-parallel one must equal."""

    def __init__(self, replicas: int, per_rank: int) -> None:
        self.replicas, self.per_rank, self.sampler = replicas, per_rank, _Epoch()

    def __iter__(self):
        shards = []
        for rank in range(self.replicas):
            seed = int(os.environ.get("PL_GLOBAL_SEED", 0))  # Lightning's seed for it
            shard = DistributedSampler(range(SAMPLES), self.replicas, rank, shuffle=True, seed=seed)
            shard.set_epoch(self.sampler.epoch)
            shards.append(list(shard))
        b = self.per_rank
        for k in range(len(self)):
            yield [i for shard in shards for i in shard[k * b : (k + 1) * b]]

    def __len__(self) -> int:
        return SAMPLES // self.replicas // self.per_rank


class Net(pl.LightningModule):
    def __init__(self, network: str = "mlp", batch_size: int = 16, replicas: int = 1) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = build(network)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        network = self.hparams.network
        if network == "lstm":  # the demo's own call: a hidden state sized by the batch
            out, _ = self.model(x, self.model.init_hidden(x.size(0)))
            return out
        if network == "transformer":
            return self.model(x, x).view(-1, 12)
        return self.model(x)

    def loss(self, batch) -> torch.Tensor:
        _, x, y = batch
        out = self(x)
        if self.hparams.network == "lstm":
            return F.nll_loss(out, y.reshape(-1))
        return F.cross_entropy(out, y.reshape(-1))

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.loss(batch), sync_dist=True)

    def test_step(self, batch, batch_idx):
        self.log("test_loss", self.loss(batch), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        index, x, _ = batch
        return index, self(x)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def _loader(self) -> DataLoader:
        return DataLoader(Samples(self.hparams.network), batch_size=self.hparams.batch_size)

    def train_dataloader(self):
        if self.hparams.replicas == 1:
            return self._loader()
        order = AsReplicas(self.hparams.replicas, self.hparams.batch_size // self.hparams.replicas)
        return DataLoader(Samples(self.hparams.network), batch_sampler=order)

    def val_dataloader(self):
        return self._loader()

    test_dataloader = predict_dataloader = val_dataloader


def weights(module: pl.LightningModule) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}


def predictions(batches) -> dict[int, torch.Tensor] | None:
    if batches is None:  # Lightning's fork launchers return none to the script
        return None
    return {
        int(i): row for index, out in batches for i, row in zip(index, out.view(len(index), -1))
    }


def launched_as(trainer: pl.Trainer) -> tuple[str | None, str | None]:
    """The cluster environment Lightning detected and the launch's start method (``None``
    where the ranks existed already: torchrun, a rank that popen started)."""
    strategy = trainer.strategy
    environment = getattr(strategy, "cluster_environment", None)  # (one process: none)
    plan = getattr(strategy, "launch_plan", None)
    return type(environment).__name__ if environment else None, getattr(plan, "method", None)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("strategy")
    parser.add_argument("network")
    parser.add_argument("out")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--start-method", default=None)
    parser.add_argument("--replicas", type=int, default=1, help="one process: read as P ranks")
    args = parser.parse_args(argv)

    def trainer(epochs: int) -> pl.Trainer:
        if args.strategy == "one":
            strategy, devices = "auto", 1
        elif args.start_method is not None:
            from lightning_par.strategies.registry import spec

            strategy = spec(args.strategy).create(start_method=args.start_method)
            devices = args.devices
        else:
            strategy, devices = args.strategy, args.devices
        return pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy,
                          max_epochs=epochs, logger=False, enable_checkpointing=False,
                          enable_progress_bar=False, enable_model_summary=False,
                          default_root_dir=args.out)  # fmt: skip

    ckpt = os.path.join(args.out, "after-fit.ckpt")
    result: dict = {"seconds": {}}
    started = time.perf_counter()

    def reach(name: str) -> str:  # the step now starting; the last one's time is kept
        nonlocal started
        result["seconds"][step] = round(time.perf_counter() - started, 2)
        started = time.perf_counter()
        return name

    first = trainer(1)
    model = Net(args.network, args.batch, args.replicas)
    step = "fit"
    result["initial"] = weights(model)
    try:
        first.fit(model)
        # in ranks that go on after fit (popen, torchrun), a model-split strategy's module
        # holds this rank's piece; after a fork the script's module is whole
        result["script_model"] = weights(model)
        result["fit_step"] = first.global_step
        result["environment"], result["launch"] = launched_as(first)
        step = reach("save_checkpoint")
        first.save_checkpoint(ckpt)
        saved = torch.load(ckpt, weights_only=True)
        result["fit"] = saved["state_dict"]
        result["saved_optimizer"] = saved["optimizer_states"]
        result["saved_step"] = saved["global_step"]
        step = reach("validate")
        result["validate"] = first.validate(model)[0]["val_loss"]
        step = reach("test")
        result["test"] = first.test(model)[0]["test_loss"]
        step = reach("predict")
        result["predict"] = predictions(first.predict(model))
        result["after_evaluation"] = weights(model)  # (validate, test, predict change none)
        step = reach("load_from_checkpoint")
        loaded = Net.load_from_checkpoint(ckpt)
        result["loaded_type"] = type(loaded).__name__
        result["loaded"] = weights(loaded)
        step = reach("resume")
        second = trainer(2)
        resumed = Net(args.network, args.batch, args.replicas)
        second.fit(resumed, ckpt_path=ckpt)
        step = reach("save_checkpoint after resume")
        second.save_checkpoint(os.path.join(args.out, "after-resume.ckpt"))
        again = torch.load(os.path.join(args.out, "after-resume.ckpt"), weights_only=True)
        result["resumed"] = again["state_dict"]
        result["resumed_step"] = again["global_step"]
        step = reach("done")
    except Exception as error:  # noqa: BLE001  (recorded for the test, which fails on it)
        result["error"] = "".join(traceback.format_exception_only(type(error), error)).strip()
        result["traceback"] = traceback.format_exc()
    result["reached"] = step
    rank = first.global_rank
    name = "result.pt" if rank == 0 else f"result-rank{rank}.pt"  # (the script's: rank 0)
    torch.save(result, os.path.join(args.out, name))
    if rank == 0:
        print(f"user flow {args.strategy} {args.network}: reached {step}", flush=True)


if __name__ == "__main__":
    main()
