"""async_sgd and the user's data: schedulers count a worker's share of each epoch (OneCycle
anneals), the rebuilt loader keeps every argument, a user's sampler is kept."""

from __future__ import annotations

import json
import multiprocessing as mp

import lightning.pytorch as pl
import torch
from _feature_cells import Tiny
from torch.utils.data import DataLoader, Sampler, TensorDataset

import lightning_par  # noqa: F401  (registers the strategy names)
from lightning_par.strategies._async_loader import rebuild_loader, user_sampler_name, worker_share
from lightning_par.strategies.async_sgd import AsyncSGDStrategy

BATCHES, BATCH, MAX_LR = 8, 4, 0.5


class OneCycle(Tiny):
    """Tiny with OneCycleLR over ``estimated_stepping_batches``; each worker writes what its
    scheduler saw and its last learning rate to ``out/rank<r>.json``."""

    def __init__(self, out: str) -> None:
        super().__init__("none")
        self.out = out

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(3)
        data = TensorDataset(torch.randn(BATCHES * BATCH, 4, generator=g),
                             torch.randint(0, 3, (BATCHES * BATCH,), generator=g))  # fmt: skip
        return DataLoader(data, batch_size=BATCH)

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=MAX_LR)
        self.estimated = self.trainer.estimated_stepping_batches
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, MAX_LR, total_steps=self.estimated)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def on_train_end(self) -> None:
        lr = self.trainer.optimizers[0].param_groups[0]["lr"]
        with open(f"{self.out}/rank{self.global_rank}.json", "w") as f:
            json.dump({"estimated": self.estimated, "lr": lr, "steps": self.global_step}, f)


def test_schedulers_count_a_workers_share_and_one_cycle_anneals(tmp_path):
    trainer = pl.Trainer(
        strategy=AsyncSGDStrategy(), accelerator="cpu", devices=2, max_epochs=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(OneCycle(str(tmp_path)))
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [s["estimated"] for s in seen] == [BATCHES // 2] * 2, seen
    assert sum(s["steps"] for s in seen) == BATCHES  # the workers shared the epoch
    for s in seen:  # annealed to (about) OneCycle's final learning rate, not mid-schedule
        assert s["lr"] < MAX_LR / 100, seen


class EveryOther(Sampler):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        return iter(range(0, self.n, 2))

    def __len__(self) -> int:
        return self.n // 2


def test_the_rebuilt_loader_keeps_every_argument_and_a_users_sampler_is_named():
    data = TensorDataset(torch.arange(16.0))
    g = torch.Generator().manual_seed(1)
    user = DataLoader(data, batch_size=4, num_workers=1, prefetch_factor=3, timeout=7.0,
                      generator=g, multiprocessing_context=mp.get_context("spawn"),
                      persistent_workers=True, pin_memory=False)  # fmt: skip
    rebuilt = rebuild_loader(user, [[0, 1], [2, 3]])
    kept = ("num_workers", "prefetch_factor", "timeout", "generator", "persistent_workers",
            "multiprocessing_context", "collate_fn", "worker_init_fn", "pin_memory")  # fmt: skip
    for name in kept:
        assert getattr(rebuilt, name) is getattr(user, name) or (
            getattr(rebuilt, name) == getattr(user, name)
        ), name
    assert list(rebuilt.batch_sampler) == [[0, 1], [2, 3]]
    assert worker_share(9, 2) == 5 and worker_share(8, 2) == 4

    from lightning.fabric.utilities.distributed import DistributedSamplerWrapper

    wrapped = DataLoader(data, sampler=DistributedSamplerWrapper(EveryOther(16), num_replicas=2,
                                                                  rank=0))  # fmt: skip
    assert user_sampler_name(wrapped) == "EveryOther"
    assert user_sampler_name(user) is None


def test_a_held_schedule_stops_at_its_end_and_its_state_dict_pickles():
    import io

    from lightning_par.strategies._async_loader import hold_final_lr

    optimizer = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1.0, total_steps=4)
    hold_final_lr(scheduler)
    hold_final_lr(scheduler)  # idempotent
    assert isinstance(scheduler, torch.optim.lr_scheduler.OneCycleLR)
    for _ in range(10):  # OneCycleLR itself raises past total_steps
        optimizer.step()
        scheduler.step()
    last = scheduler.get_last_lr()
    assert scheduler.last_epoch == 3 and last == [optimizer.param_groups[0]["lr"]]
    state = scheduler.state_dict()
    assert "step" not in state and "_lightning_par_held" not in state
    torch.save(state, io.BytesIO())  # a checkpoint holds it
