"""Gradient clipping and bf16-mixed under parameter_server and async_sgd, against one process.

Two workers, one or two servers, a fork launch (the strategies' timeout, 20 s under the
tests, ends the whole group and names the silent rank). Each worker reads its half of
every global batch, so together they read one process's batch."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.plugins import MixedPrecision
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import lightning_par  # noqa: F401  (registers the strategy names)
from lightning_par.comm import Communicator, run_on_ranks
from lightning_par.paramserver import ParameterClient, serve
from lightning_par.paramserver.clipping import GradClip, clip_flat, from_trainer, norm_factor
from lightning_par.strategies._ps_features import check_precision
from lightning_par.strategies.async_sgd import AsyncSGDStrategy
from lightning_par.strategies.parameter_server import ParameterServerStrategy

GLOBAL_BATCH, STEPS = 8, 3
pytestmark = pytest.mark.timeout(120)


class Tiny(pl.LightningModule):
    """Two linear layers; records the gradient norm Lightning sees before it clips."""

    def __init__(self, lr: float = 0.2, momentum: float = 0.9, rows: int | None = None) -> None:
        super().__init__()
        self.rows = rows  # rows per batch (default: this rank's share of the global batch)
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
        self.lr, self.momentum = lr, momentum
        self.norms: list[float] = []
        self.dtype_log: str | None = None  # a folder: each rank writes its output dtype

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self.net(x)
        if self.dtype_log is not None:
            with open(f"{self.dtype_log}/rank{self.global_rank}", "a") as f:
                f.write(f"{out.dtype}\n")
        return F.cross_entropy(out.float(), y)

    def on_before_optimizer_step(self, optimizer):
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        self.norms.append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(3)
        x = torch.randn(STEPS * GLOBAL_BATCH, 6, generator=g) * 3
        y = torch.randint(0, 3, (STEPS * GLOBAL_BATCH,), generator=g)
        world, rank = self.trainer.world_size, self.global_rank
        per = GLOBAL_BATCH // world
        index = torch.cat([torch.arange(i * GLOBAL_BATCH + rank * per,
                                        i * GLOBAL_BATCH + (rank + 1) * per)
                           for i in range(STEPS)])  # fmt: skip
        return DataLoader(TensorDataset(x[index], y[index]), batch_size=self.rows or per)


def fit(model: pl.LightningModule, strategy, devices: int, **kw) -> pl.LightningModule:
    pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=devices, max_steps=STEPS, logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        use_distributed_sampler=False, **kw,
    ).fit(model)  # fmt: skip
    return model


def weights(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def small(**kw):
    """Several buckets; with two servers every weight matrix split over both."""
    return {"bucket_cap_mb": 0.0002, "split_mb": 0.0001, **kw}


CLIP = {"norm": 0.5, "value": 0.05}


@pytest.mark.parametrize(
    "algorithm,servers",
    [("norm", 1), ("norm", 2), ("value", 1), ("value", 2)],
    ids=["norm-1", "norm-2", "value-1", "value-2"],
)
def test_clipping_equals_one_process(algorithm, servers):
    clip = {"gradient_clip_val": CLIP[algorithm], "gradient_clip_algorithm": algorithm}
    reference = fit(Tiny(), "auto", 1, **clip)
    if algorithm == "norm":  # the clip did clip: the unclipped norm exceeded it every step
        assert min(reference.norms) > CLIP["norm"], reference.norms
    unclipped = fit(Tiny(), "auto", 1)
    assert not torch.allclose(weights(unclipped), weights(reference), atol=1e-3)
    model = fit(Tiny(), ParameterServerStrategy(num_servers=servers, **small()), 2, **clip)
    torch.testing.assert_close(weights(model), weights(reference), rtol=1e-5, atol=1e-6)


def test_async_sgd_staleness_0_clips_the_mean_on_the_servers():
    clip = {"gradient_clip_val": CLIP["norm"], "gradient_clip_algorithm": "norm"}
    reference = fit(Tiny(), "auto", 1, **clip)
    model = fit(Tiny(), AsyncSGDStrategy(num_servers=2, staleness=0, split_mb=0.0001), 2, **clip)
    torch.testing.assert_close(weights(model), weights(reference), rtol=1e-5, atol=1e-6)


def test_async_sgd_clips_each_push_by_its_own_norm():
    # plain SGD with lr 1: each applied update is minus one worker's clipped gradient, so
    # the weights move at most (updates x clip); unclipped they move much further
    c = 0.01
    clip = {"gradient_clip_val": c, "gradient_clip_algorithm": "norm"}
    reference = fit(Tiny(lr=1.0, momentum=0.0), "auto", 1)
    assert min(reference.norms) > 10 * c  # unclipped, each step would move them further
    start = weights(Tiny())
    model = Tiny(lr=1.0, momentum=0.0)
    fit(model, AsyncSGDStrategy(num_servers=2, staleness=None, split_mb=0.0001), 2, **clip)
    moved = float((weights(model) - start).norm())
    updates = 2 * STEPS  # each worker pushes each of its steps
    assert 0 < moved <= updates * c * (1 + 1e-4)


@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_async_sgd_one_worker_clips_as_one_process(algorithm):
    # one worker's pushes, each clipped at the worker, are one process's clipped steps
    clip = {"gradient_clip_val": CLIP[algorithm], "gradient_clip_algorithm": algorithm}
    reference = fit(Tiny(), "auto", 1, **clip)
    model = fit(Tiny(), AsyncSGDStrategy(num_servers=2, split_mb=0.0001), 1, **clip)
    torch.testing.assert_close(weights(model), weights(reference), rtol=1e-5, atol=1e-6)


def test_bf16_mixed_equals_one_process_under_bf16_mixed(tmp_path):
    reference = fit(Tiny(), "auto", 1, precision="bf16-mixed")
    fp32 = fit(Tiny(), "auto", 1)
    model = Tiny()
    model.dtype_log = str(tmp_path)
    fit(model, ParameterServerStrategy(num_servers=2, **small()), 2, precision="bf16-mixed")
    for rank in range(2):  # both workers computed in autocast, every step
        assert (tmp_path / f"rank{rank}").read_text().split() == ["torch.bfloat16"] * STEPS
    assert all(p.dtype == torch.float32 for p in model.parameters())
    # exact: one process summing the same two half batches' bf16 gradients in fp32
    halves = fit(Tiny(rows=GLOBAL_BATCH // 2), "auto", 1, precision="bf16-mixed",
                 accumulate_grad_batches=2)  # fmt: skip
    torch.testing.assert_close(weights(model), weights(halves), rtol=1e-5, atol=1e-6)
    # and one process on the whole batch: a worker's gradient sums 4 rows in bf16 where
    # one process sums 8, which rounds differently (as under Lightning's DDP)
    moved = float((weights(reference) - weights(Tiny())).abs().max())
    diff = float((weights(model) - weights(reference)).abs().max())
    assert diff < 1e-2 * moved, (diff, moved)
    assert not torch.allclose(weights(fp32), weights(reference), rtol=0, atol=1e-4)  # bf16 did


@pytest.mark.parametrize("strategy", [ParameterServerStrategy, AsyncSGDStrategy])
def test_16_mixed_is_refused_before_launch_naming_strategy_and_plugin(strategy):
    # on CPU Lightning turns precision="16-mixed" into bf16-mixed: the plugin itself
    name, fp16 = strategy.strategy_name, MixedPrecision("16-mixed", "cpu")
    options = [{}, {"fault_tolerant": True}] if strategy is ParameterServerStrategy else [{}]
    for option in options:  # (fault_tolerant: the same refusal, before any rank starts)
        with pytest.raises(ValueError, match=rf"^{name} refuses precision='16-mixed' \(Mixed"):
            fit(Tiny(), strategy(**option), 2, plugins=[fp16])
    with pytest.raises(ValueError, match=rf"^{name} runs precision '32-true' or 'bf16-mixed'"):
        fit(Tiny(), strategy(), 2, precision="bf16-true")


class OwnClipping(Tiny):
    def configure_gradient_clipping(
        self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None
    ):
        pass


@pytest.mark.parametrize("strategy", [ParameterServerStrategy, AsyncSGDStrategy])
def test_a_configure_gradient_clipping_override_is_refused(strategy):
    with pytest.raises(ValueError, match=rf"^{strategy.strategy_name} cannot run OwnClipping"):
        fit(OwnClipping(), strategy(), 2)


# ---- the plain module ----------------------------------------------------------------------


def test_clip_flat_is_torchs_clipping():
    torch.manual_seed(1)
    params = [nn.Parameter(torch.randn(5, 4)), nn.Parameter(torch.randn(7))]
    for algorithm, value in [("norm", 0.3), ("norm", 1e3), ("value", 0.2)]:
        grads = [torch.randn_like(p) for p in params]
        ours = [g.clone() for g in grads]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        if algorithm == "norm":
            before = torch.nn.utils.clip_grad_norm_(params, value)
            assert clip_flat(ours, GradClip(value, "norm")) == pytest.approx(float(before))
        else:
            torch.nn.utils.clip_grad_value_(params, value)
            clip_flat(ours, GradClip(value, "value"))
        for p, g in zip(params, ours):
            torch.testing.assert_close(g, p.grad, rtol=1e-6, atol=1e-7)
    assert norm_factor(4.0, 10.0) == 1.0 and norm_factor(4.0, 1.0) == pytest.approx(0.5)


def test_bad_clipping_and_precision_are_clear_errors():
    assert from_trainer(None, None) is None and from_trainer(0, "norm") is None
    assert from_trainer(1.0, None) == GradClip(1.0, "norm")
    with pytest.raises(ValueError, match="'norm' or 'value'"):
        GradClip(1.0, "l1")
    check_precision("parameter_server", "bf16-mixed")  # accepted
    with pytest.raises(ValueError, match="parameter_server runs precision"):
        check_precision("parameter_server", "64-true")


# ---- Lightning-free: a server holding nothing still takes part in the norm exchange ------


def _linear() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(5, 3)  # two tensors, three servers: one server holds no slice


def _data():
    g = torch.Generator().manual_seed(2)
    n = STEPS * 8
    return torch.randn(n, 5, generator=g) * 4, torch.randint(0, 3, (n,), generator=g)


def _clip_rank(rank: int, world: int, workers: int, clip: GradClip):
    comm = Communicator()
    if rank >= workers:
        serve(comm, rank - workers)
        return None
    model, (x, y) = _linear(), _data()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    client = ParameterClient(model, opt, comm, workers, world - workers, clip=clip)
    assert not client.plan.of_server(world - workers - 1)  # the last server holds nothing
    per = 8 // workers
    for step in range(STEPS):
        lo = step * 8 + rank * per
        F.cross_entropy(model(x[lo : lo + per]), y[lo : lo + per]).backward()
        client.finish_backward()
        opt.zero_grad()
    client.close()
    return weights(model).numpy()


def test_a_server_with_no_slice_still_exchanges_its_norm():
    clip = GradClip(0.3, "norm")
    model, (x, y) = _linear(), _data()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(STEPS):
        F.cross_entropy(model(x[step * 8 : step * 8 + 8]), y[step * 8 : step * 8 + 8]).backward()
        assert torch.nn.utils.clip_grad_norm_(model.parameters(), clip.value) > clip.value
        opt.step()
        opt.zero_grad()
    out = run_on_ranks(_clip_rank, 5, 2, clip, timeout=60)
    for got in out[:2]:
        torch.testing.assert_close(torch.from_numpy(got), weights(model), rtol=1e-5, atol=1e-6)


class WithLBFGS(Tiny):
    def configure_optimizers(self):
        return torch.optim.LBFGS(self.parameters())


def test_an_optimiser_that_is_not_elementwise_is_refused_naming_the_strategy():
    with pytest.raises(Exception, match=r"async_sgd cannot run LBFGS: its servers apply"):
        fit(WithLBFGS(), AsyncSGDStrategy(num_servers=1), 2)
