"""AsyncSGDStrategy under Lightning: s=0 equals parameter_server, workers do not wait for
each other (no per-batch collective), staleness logged and traced, refusals."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import StrategyRegistry
from test_parameter_server import CNN, PER_WORKER, fit, make, weights

import lightning_par  # noqa: F401  (registers the strategy names)
from lightning_par.callbacks import Straggler
from lightning_par.comm.trace import load_traces
from lightning_par.strategies.async_sgd import AsyncSGDStrategy, staleness_histogram
from lightning_par.strategies.parameter_server import ParameterServerStrategy


def test_staleness_zero_equals_parameter_server():
    sync = make("cnn")
    fit(sync, ParameterServerStrategy(num_servers=2, split_mb=0.005), 2)
    ssp0 = make("cnn")
    fit(ssp0, AsyncSGDStrategy(num_servers=2, staleness=0, split_mb=0.005), 2)
    torch.testing.assert_close(weights(ssp0), weights(sync), atol=1e-6, rtol=1e-6)
    assert not torch.equal(weights(ssp0), weights(make("cnn")))  # it trained


def test_workers_never_wait_and_staleness_is_logged_and_traced(tmp_path):
    assert "async_sgd" in StrategyRegistry
    strategy = AsyncSGDStrategy(trace_dir=tmp_path / "trace")
    model = make("cnn", scheduler=None)
    trainer = fit(model, strategy, 2, steps=8, callbacks=[Straggler(rank=1, slowdown=6.0)])
    assert "staleness" in trainer.callback_metrics
    traces = load_traces(tmp_path / "trace")
    slow = staleness_histogram(traces[1])
    assert sum(slow.values()) == 8  # every update of the slow worker recorded
    # In lock-step (a per-batch collective among workers) the fast worker could update at
    # most once while the straggler computed; here it runs several steps ahead.
    assert max(slow) >= 2
    assert sum(staleness_histogram(traces).values()) == 16
    assert not torch.equal(weights(model), weights(make("cnn", scheduler=None)))


def test_bounded_staleness_under_a_straggler(tmp_path):
    strategy = AsyncSGDStrategy(staleness=1, trace_dir=tmp_path / "trace")
    fit(make("cnn", scheduler=None), strategy, 2, steps=4,
        callbacks=[Straggler(rank=1, slowdown=6.0)])  # fmt: skip
    # with s=1 and two workers an update is at most (W-1)(2s+1) = 3 updates stale
    assert max(staleness_histogram(load_traces(tmp_path / "trace"))) <= 3


def test_checkpoint_holds_the_servers_optimiser_state(tmp_path):
    model = make("cnn", scheduler=None)
    trainer = fit(model, AsyncSGDStrategy(), 2, steps=2, default_root_dir=tmp_path,
                  enable_checkpointing=True)  # fmt: skip
    saved = torch.load(trainer.checkpoint_callback.best_model_path, weights_only=False)
    state = saved["optimizer_states"][0]["state"]
    assert len(state) == len(list(model.parameters()))
    assert all(s["momentum_buffer"].abs().sum() > 0 for s in state.values())


def test_bad_options_are_refused():
    with pytest.raises(ValueError, match="staleness"):
        AsyncSGDStrategy(staleness=-1)
    with pytest.raises(TypeError, match="staleness"):
        AsyncSGDStrategy(staleness=1.5)
    with pytest.raises(TypeError, match="bucket_cap_mb"):
        AsyncSGDStrategy(bucket_cap_mb=1.0)
    with pytest.raises(ValueError, match="num_servers"):
        AsyncSGDStrategy(num_servers=0)


def test_remedies_train_under_a_straggler(tmp_path):
    """Every remedy on at once: the servers apply them to every push and the run trains."""
    strategy = AsyncSGDStrategy(staleness_lr=True, dc_lambda=2.0, dc_mean_square=0.9,
                                momentum=0.5, trace_dir=tmp_path / "trace")  # fmt: skip
    model = make("cnn", scheduler=None)
    fit(model, strategy, 2, steps=6, callbacks=[Straggler(rank=1, slowdown=4.0)])
    assert sum(staleness_histogram(load_traces(tmp_path / "trace")).values()) == 12
    trained = weights(model)
    assert torch.isfinite(trained).all() and not torch.equal(trained, weights(make("cnn")))


def test_momentum_remedy_refuses_an_optimiser_without_momentum():
    torch.manual_seed(0)
    model = CNN(width=8, num_blocks=2, optimizer="adam", scheduler=None, lr=0.01)
    model.global_batch = 8
    # raised in every worker at setup (the optimiser is known only there), before a push
    with pytest.raises(Exception, match=r"momentum=0.5\) sets the servers' momentum, but Adam"):
        fit(model, AsyncSGDStrategy(momentum=0.5), 2, steps=2)


def test_the_automatic_momentum_cap_is_announced(tmp_path, capfd):
    import logging

    # The line comes from rank 0 through Lightning's logger. A forked rank takes the handler
    # added here with it; a forkserver's rank (where fork is unsafe: a GPU machine after a
    # backward pass) starts with Lightning's own, which writes to standard error.
    log = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    handler = logging.FileHandler(tmp_path / "log.txt")
    log.addHandler(handler)
    try:
        fit(make("cnn", scheduler=None), AsyncSGDStrategy(), 2, steps=2)  # SGD, momentum 0.9
    finally:
        log.removeHandler(handler)
        handler.close()
    text = (tmp_path / "log.txt").read_text() + capfd.readouterr().err
    assert "servers step with momentum 0.5 instead of the optimiser's 0.9" in text, text


class UpdatedOnly(CNN):
    """Its training accuracy only ``update``-d, the usual torchmetrics pattern (its
    ``forward``, which refreshes what ``compute`` syncs, is never called)."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.train_acc.update(logits, y)
        self.log("train_acc", self.train_acc, on_step=False, on_epoch=True)
        return torch.nn.functional.cross_entropy(logits, y)


class CollectivesAtCompute(pl.Callback):
    """Counts the barriers the training accuracy's ``compute`` calls at the epoch's end (each
    worker's epoch ends on its own: a gather there waits for a worker still training, which
    under bounded staleness may wait for the servers on it, a deadlock a notebook hit)."""

    def __init__(self, out) -> None:
        self.out = out

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        calls = []
        barrier = torch.distributed.barrier
        torch.distributed.barrier = lambda *args, **kwargs: calls.append(1)
        try:
            pl_module.train_acc.compute()
        finally:
            torch.distributed.barrier = barrier
        (self.out / f"rank{trainer.global_rank}").write_text(str(len(calls)))


def test_a_metric_only_updated_gathers_nothing_while_fitting(tmp_path):
    model = UpdatedOnly(width=8, num_blocks=2, scheduler=None, lr=0.05)
    model.global_batch = 2 * PER_WORKER
    fit(model, AsyncSGDStrategy(), 2, steps=3, callbacks=[CollectivesAtCompute(tmp_path)],
        limit_train_batches=3)  # fmt: skip
    assert [(tmp_path / f"rank{r}").read_text() for r in range(2)] == ["0", "0"]
