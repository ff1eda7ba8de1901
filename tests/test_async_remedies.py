"""Remedies for stale updates (lightning_par.paramserver.remedies): the formulas on hand-made
tensors, and the asynchronous server applying them to pushes in a chosen order."""

from __future__ import annotations

import pytest
import torch
from lightning.fabric.plugins.environments import LightningEnvironment
from torch import nn

from lightning_par.paramserver.asynchronous import AsyncServer
from lightning_par.paramserver.plan import plan_shards
from lightning_par.paramserver.protocol import Command, Header, encode_push
from lightning_par.paramserver.remedies import (
    Remedies,
    adaptive_lambda,
    cap_momentum,
    compensate,
    staleness_scale,
)
from lightning_par.paramserver.server import ShardOptimizer
from lightning_par.paramserver.spec import hyper_values, server_spec
from lightning_par.strategies.async_sgd import AsyncSGDStrategy


def test_formulas_on_hand_made_tensors():
    assert [staleness_scale(t) for t in (0, 1, 2, 4)] == [1.0, 1.0, 0.5, 0.25]
    g = torch.tensor([1.0, -2.0, 0.5])
    w, read = torch.tensor([0.3, 0.1, -1.0]), torch.tensor([0.1, 0.4, -1.0])
    # g + lambda g*g (w - read), element by element
    expected = torch.tensor([1.0 + 0.5 * 1 * 0.2, -2.0 + 0.5 * 4 * -0.3, 0.5 + 0])
    torch.testing.assert_close(compensate(g, w, read, 0.5), expected)
    ms = torch.tensor([1.0, 1.0, 4.0])
    lam = adaptive_lambda(g, ms, 2.0, 0.75, eps=0.0)  # MS <- 0.75 MS + 0.25 g*g
    torch.testing.assert_close(ms, torch.tensor([1.0, 1.75, 3.0625]))
    torch.testing.assert_close(lam, 2.0 / torch.tensor([1.0, 1.75, 3.0625]).sqrt())


class FakeComm:
    """Records what the server sends; every send completes at once."""

    def __init__(self) -> None:
        self.sent: list[tuple[int, torch.Tensor]] = []

    def isend(self, tensor, dst, **kwargs):
        self.sent.append((dst, tensor.clone()))
        return self

    def wait(self, *args):
        return None


def make_server(remedies: Remedies, momentum: float = 0.0):
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.1, momentum=momentum)
    plan = plan_shards([p.numel() for p in params], [4, 4], 1)
    spec = server_spec(opt, params, 2, [[0, 1]], plan)
    shard = ShardOptimizer(spec, 0)
    shard.flat[0].copy_(torch.cat([p.detach().flatten() for p in params]))
    hyper = hyper_values(opt.param_groups, spec.schemas)
    return AsyncServer(FakeComm(), shard, None, remedies), hyper


def push(server: AsyncServer, worker: int, grad: torch.Tensor, hyper) -> None:
    header = Header(Command.STEP, 0, tuple(hyper))
    flags = [torch.tensor(1.0), torch.tensor(1.0)]
    server._handle(worker, header, [encode_push([grad[:6], grad[6:]], flags)])


def three_pushes(remedies: Remedies, momentum: float = 0.0):
    """Worker 0 pushes twice (fresh), then worker 1 its gradient of the initial weights
    (2 updates stale). Returns the weights after each push and the gradients."""
    server, hyper = make_server(remedies, momentum)
    g = [torch.linspace(-1, 1, 8) * (k + 1) for k in range(3)]
    after = [server.shard.flat[0].clone()]
    for worker, grad in zip((0, 0, 1), g):
        push(server, worker, grad, hyper)
        after.append(server.shard.flat[0].clone())
    assert [s for _, s, _ in server.history] == [0, 0, 2]
    return after, g


def test_server_plain_update_is_sgd():
    w, g = three_pushes(Remedies())
    for k in range(3):
        torch.testing.assert_close(w[k + 1], w[k] - 0.1 * g[k])


def test_server_staleness_lr_divides_a_stale_update():
    w, g = three_pushes(Remedies(staleness_lr=True))
    torch.testing.assert_close(w[2], w[0] - 0.1 * (g[0] + g[1]))  # fresh: the full rate
    torch.testing.assert_close(w[3], w[2] - 0.1 / 2 * g[2])  # 2 stale: eta / 2


def test_server_delay_compensation_uses_the_weights_the_worker_read():
    w, g = three_pushes(Remedies(dc_lambda=3.0))
    # worker 0 read the weights before each of its pushes: no correction
    torch.testing.assert_close(w[2], w[0] - 0.1 * (g[0] + g[1]))
    # worker 1 read the initial weights w[0]; the server holds w[2]
    corrected = g[2] + 3.0 * g[2] * g[2] * (w[2] - w[0])
    torch.testing.assert_close(w[3], w[2] - 0.1 * corrected)
    assert not torch.allclose(corrected, g[2])


def test_server_adaptive_delay_compensation():
    w, g = three_pushes(Remedies(dc_lambda=2.0, dc_mean_square=0.5))
    ms = torch.zeros(8)
    for grad in g:
        ms = 0.5 * ms + 0.5 * grad * grad
    lam = 2.0 / (ms + 1e-7).sqrt()
    torch.testing.assert_close(w[3], w[2] - 0.1 * (g[2] + lam * g[2] * g[2] * (w[2] - w[0])))


def test_momentum_is_capped_not_raised():
    groups = [{"momentum": 0.3}, {"momentum": 0.9}, {"betas": (0.9, 0.99)}]
    cap_momentum(groups[:2], 0.5)
    assert [g["momentum"] for g in groups[:2]] == [0.3, 0.5]
    cap_momentum(groups, 0.5, strict=False)  # an optimiser without momentum: left alone
    assert groups[2] == {"betas": (0.9, 0.99)}
    with pytest.raises(ValueError, match="'momentum' setting"):
        cap_momentum(groups, 0.5)


def test_default_remedy_is_the_measured_best():
    """The benchmark's best (benchmarks/async.md): momentum at most 0.5 on the servers,
    where the optimiser has one; none at staleness=0 (synchronous)."""
    assert AsyncSGDStrategy().remedies == Remedies(momentum=0.5, strict=False)
    assert AsyncSGDStrategy(staleness=4).remedies.momentum == 0.5
    assert AsyncSGDStrategy(staleness=0).remedies == Remedies(strict=False)
    assert AsyncSGDStrategy(momentum=None).remedies == Remedies()
    strategy = AsyncSGDStrategy()
    for world, momentum in ((1, None), (2, 0.5)):  # one worker: no asynchrony, no cap
        env = LightningEnvironment()
        env.set_world_size(world)
        strategy.cluster_environment = env
        assert strategy._server_options()["remedies"].momentum == momentum


def test_server_momentum_replaces_the_models():
    w, g = three_pushes(Remedies(momentum=0.5), momentum=0.9)
    buf = torch.zeros(8)
    for k in range(3):  # SGD with momentum 0.5, not the model's 0.9
        buf = 0.5 * buf + g[k]
        torch.testing.assert_close(w[k + 1], w[k] - 0.1 * buf)


def test_remedies_are_checked():
    with pytest.raises(ValueError, match="dc_lambda"):
        Remedies(dc_lambda=-1.0)
    with pytest.raises(ValueError, match="dc_mean_square"):
        Remedies(dc_lambda=1.0, dc_mean_square=1.0)
    with pytest.raises(ValueError, match="dc_lambda > 0"):
        Remedies(dc_mean_square=0.9)
    with pytest.raises(ValueError, match="momentum"):
        Remedies(momentum=1.5)
    with pytest.raises(TypeError, match="staleness_lr"):
        Remedies(staleness_lr=1)
    with pytest.raises(ValueError, match="staleness=0"):
        AsyncSGDStrategy(staleness=0, staleness_lr=True)
    assert str(Remedies(staleness_lr=True, momentum=0.5)) == "staleness_lr+momentum=0.5"


def test_strategy_hands_the_remedies_to_the_servers():
    strategy = AsyncSGDStrategy(staleness_lr=True, dc_lambda=0.5, momentum=0.0)
    assert strategy._server_options()["remedies"] == Remedies(True, 0.5, None, 0.0)
