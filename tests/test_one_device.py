"""At one process the data-parallel plugins cost nothing extra: no gradient buckets, no
gradient hooks, no communication thread and no messages, and the weights of plain SGD.

The fit runs inside a one-rank ``run_on_ranks`` launch (the process group exists, as under
torchrun), so no rank of this test can leave a thread or a group behind in pytest.
"""

from __future__ import annotations

import threading

import lightning.pytorch as pl
import torch
from test_allreduce_strategies import (
    flat_weights,
    global_batches,
    make_model,
    portable,
    shard,
    single_process,
)
from test_allreduce_strategies import trainer as make_trainer

import lightning_par  # noqa: F401  (registers the strategy names)
from lightning_par.comm import run_on_ranks
from lightning_par.strategies.allreduce import AllReduceStrategy
from lightning_par.strategies.local_sgd import LocalSGDStrategy

STEPS = 3


def _hooks(model: torch.nn.Module) -> int:
    """Post-accumulate-grad hooks on the model's parameters (how buckets learn of gradients)."""
    return sum(
        len(getattr(p, "_post_accumulate_grad_hooks", None) or {}) for p in model.parameters()
    )


def _fit_alone(rank: int, world_size: int) -> dict:
    x, y = global_batches(1, steps=STEPS)
    out = {}
    strategies = {
        "ring_allreduce": lambda: AllReduceStrategy("ring", trace=True),
        "tree_allreduce": lambda: AllReduceStrategy("tree", trace=True),
        "local_sgd": lambda: LocalSGDStrategy(period=1, trace=True),
    }
    for name, make in strategies.items():
        model = make_model("cnn")
        strategy = make()
        seen = {}

        def during_fit(trainer, pl_module, *args, seen=seen, **kwargs):
            seen["hooks"] = _hooks(pl_module)
            seen["buckets"] = getattr(trainer.strategy, "buckets", None) is not None
            seen["threads"] = sorted(
                t.name for t in threading.enumerate() if t.name.startswith("lightning_par")
            )

        callback = pl.Callback()
        callback.on_train_batch_end = during_fit  # (during the fit, before teardown)
        make_trainer(strategy, 1, max_steps=STEPS, callbacks=[callback]).fit(
            model, shard(x, y, 0, 1)
        )
        out[name] = {
            **seen,
            "messages": len(strategy.trace.messages),
            "events": sorted({e.name for e in strategy.trace.events}),
            "weights": portable(flat_weights(model)),
        }
    return out


def test_one_process_creates_no_buckets_hooks_threads_or_messages():
    (result,) = run_on_ranks(_fit_alone, 1, timeout=120)
    x, y = global_batches(1, steps=STEPS)
    reference = make_model("cnn")
    expected = single_process(reference, reference.state_dict(), x, y, 4, STEPS)
    for name, seen in result.items():
        assert seen["buckets"] is False, name
        assert seen["hooks"] == 0, name
        assert seen["threads"] == [], name
        assert seen["messages"] == 0, name
        assert seen["events"] == [], name  # no bucket, wait or averaging spans either
        # and it trains as plain SGD on the same batches
        assert torch.allclose(torch.from_numpy(seen["weights"]), expected, atol=1e-6), name
