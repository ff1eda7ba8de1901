"""The hybrid strategy: its dp x mp grid, the same weights as one process on the global batch,
groups read back from a real trace, full-model checkpoints, and a bad grid refused before
any process starts."""

from __future__ import annotations

import copy

import lightning.pytorch as pl
import pytest
import torch
from _split_models import STEPS
from _split_models import trainer as _trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

from lightning_par.collectives.cost_model import ring_cost
from lightning_par.comm.buckets import make_buckets
from lightning_par.comm.trace import load_traces
from lightning_par.compare.costs import hybrid_bytes
from lightning_par.components.pipeline_split import PipelineSplit
from lightning_par.components.tensor_split import TensorParallelSplit
from lightning_par.components.wavefront_split import WavefrontSplit
from lightning_par.data import SyntheticCIFAR10
from lightning_par.hybrid import Grid, make_grid, talk_groups
from lightning_par.models import CifarCNN, CifarRNN
from lightning_par.pipeline import balance_by_params, split_sequential
from lightning_par.strategies.hybrid import HybridStrategy

SIZE, GLOBAL_BATCH = 24, 8
#: In float64: a float32 run's rounding (summing per replica and per micro-batch, then
#: averaging) may flip a ReLU near 0 and move these tiny CNNs by ~1e-4 within 3 steps, which
#: would hide a real difference; double precision keeps the comparison tight.
PRECISION = "64-true"
RING_TAGS = ("reduce-scatter", "all-gather")


# ---- the grid: plain functions ---------------------------------------------------------------
def test_grid_rows_are_mp_groups_and_columns_dp_groups():
    grid = Grid(dp=2, mp=3)
    assert grid.mp_groups() == [[0, 1, 2], [3, 4, 5]]
    assert grid.dp_groups() == [[0, 3], [1, 4], [2, 5]]
    assert [grid.coords(r) for r in (0, 2, 4)] == [(0, 0), (0, 2), (1, 1)]
    assert grid.mp_group_of(4) == [3, 4, 5] and grid.dp_group_of(4) == [1, 4]
    # every rank in exactly one group of each kind, and the two meet in one rank
    for r in range(6):
        assert set(grid.mp_group_of(r)) & set(grid.dp_group_of(r)) == {r}
    with pytest.raises(ValueError, match="outside a grid of 6"):
        grid.coords(6)


def test_make_grid_derives_the_missing_degree():
    assert make_grid(4) == Grid(2, 2)  # the default: mp = 2
    assert make_grid(8, dp=2) == Grid(2, 4)
    assert make_grid(6, mp=3) == Grid(2, 3)
    assert make_grid(4, dp=4, mp=1) == Grid(4, 1)
    with pytest.raises(ValueError, match=r"dp=3 x mp=2 = 6 ranks but there are 4 processes"):
        make_grid(4, dp=3, mp=2)
    with pytest.raises(ValueError, match=r"mp=2 does not divide the 3 processes .*mp defaults"):
        make_grid(3)
    with pytest.raises(ValueError, match="dp=4 does not divide the 6 processes"):
        make_grid(6, dp=4)
    with pytest.raises(ValueError, match="mp must be an int >= 1"):
        make_grid(4, mp=0)


def test_talk_groups_are_connected_components():
    from lightning_par.comm import CommTrace, Message

    traces = [CommTrace(rank=r) for r in range(4)]
    traces[0].record(Message(0, "send", 1, 4, 0.0, 1.0, tag="act"))
    traces[2].record(Message(2, "send", 0, 4, 0.0, 1.0, tag="all-gather"))
    traces[3].record(Message(3, "recv", 1, 4, 0.0, 1.0, tag="grad"))
    assert talk_groups(traces, RING_TAGS) == [[0, 2], [1], [3]]
    assert talk_groups(traces, exclude=RING_TAGS) == [[0, 1, 3], [2]]


# ---- refused before launch --------------------------------------------------------------------
def test_bad_options_are_refused_when_the_strategy_is_made():
    with pytest.raises(
        ValueError,
        match=r"mp_kind='ring': choose one of \['gpipe', 'layerwise', 'tensor_parallel'\]",
    ):
        HybridStrategy(mp_kind="ring")
    with pytest.raises(ValueError, match="dp must be an int >= 1"):
        HybridStrategy(dp=0)
    with pytest.raises(ValueError, match="dp_algorithm='rings'"):
        HybridStrategy(dp_algorithm="rings")
    with pytest.raises(ValueError, match="bucket_cap_mb must be > 0"):
        HybridStrategy(bucket_cap_mb=0)
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['bogus'\].*time_chunk"):
        HybridStrategy(mp_kind="layerwise", bogus=1)
    with pytest.raises(ValueError, match="tensor_parallel: algorithm='butterfly' is not supp"):
        HybridStrategy(mp_kind="tensor_parallel", algorithm="butterfly")  # the row's option
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['chunks'\] for mp_kind='tensor_"):
        HybridStrategy(mp_kind="tensor_parallel", chunks=4)  # another kind's option


@pytest.mark.parametrize(
    "strategy, devices, message",
    [
        (HybridStrategy(dp=3, mp=2), 4, r"dp=3 x mp=2 = 6 ranks but there are 4 processes"),
        (HybridStrategy(), 3, "mp=2 does not divide the 3 processes"),
        (HybridStrategy(dp=1, mp=4, balance=[2, 2]), 4, "balance .* has 2 stages but there are 4"),
        (HybridStrategy(mp_kind="layerwise", time_chunk=2), 4, "needs recurrent layers"),
    ],
)
def test_bad_grid_fails_before_any_process_starts(strategy, devices, message):
    trainer = _trainer(strategy, devices)
    with pytest.raises((ValueError, TypeError), match=message):
        trainer.fit(_model("cnn"), _loader(1))


def test_registered_name_defaults_to_a_2_by_2_gpipe_grid():
    trainer = _trainer("hybrid", 4)
    strategy = trainer.strategy
    assert type(strategy) is HybridStrategy and type(strategy.splitter) is PipelineSplit
    assert strategy.splitter.chunks == 4  # (the wavefront's splitter is WavefrontSplit)
    assert strategy.grid == Grid(2, 2) and strategy.num_stages == 2
    assert strategy.distributed_sampler_kwargs == {"num_replicas": 2, "rank": 0}


# ---- training: the same weights as one process --------------------------------------------------
def _model(kind: str) -> pl.LightningModule:
    torch.manual_seed(0)
    if kind == "cnn":
        return CifarCNN(width=8, num_blocks=2, scheduler=None)
    return CifarRNN(hidden_size=16, num_layers=2, scheduler=None)


def _loader(dp: int) -> DataLoader:
    return DataLoader(SyntheticCIFAR10(SIZE, seed=1), batch_size=GLOBAL_BATCH // dp)


def _single_process(model: pl.LightningModule, dp: int, **kw) -> dict[str, torch.Tensor]:
    """One process on the global batches the dp replicas read together: Lightning shuffles
    the training data with a DistributedSampler per replica, so replay the same shards."""
    data = SyntheticCIFAR10(SIZE, seed=1)
    shards = [list(DistributedSampler(data, dp, r, shuffle=True, seed=0)) for r in range(dp)]
    per = GLOBAL_BATCH // dp
    steps = range(len(shards[0]) // per)
    order = [i for k in steps for shard in shards for i in shard[k * per : (k + 1) * per]]
    reference = copy.deepcopy(model)
    _trainer("auto", 1, precision=PRECISION, **kw).fit(
        reference, DataLoader(data, batch_size=GLOBAL_BATCH, sampler=order)
    )
    return reference.state_dict()


def _assert_same_weights(got: dict, expected: dict) -> None:
    """Equal to float64 rounding; the model handed back to the float32 main process is cast,
    so there to one float32 rounding."""
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        single = got[key].dtype == torch.float32
        tol = {"rtol": 3e-7, "atol": 1e-9} if single else {"rtol": 1e-10, "atol": 1e-12}
        torch.testing.assert_close(got[key], value.to(got[key].dtype), **tol, msg=key)


def _assert_grid_traffic(trace_dir) -> list:
    """Who talked to whom on a 2 x 2 grid: the gradient buckets' ring allreduce inside the
    columns, everything else (activations, their gradients, tensor-parallel allreduces, the
    checkpoint's gathering) inside the rows."""
    traces = load_traces(trace_dir)
    assert [t.rank for t in traces] == [0, 1, 2, 3]
    assert talk_groups(traces, RING_TAGS) == Grid(2, 2).dp_groups() == [[0, 2], [1, 3]]
    assert talk_groups(traces, exclude=RING_TAGS) == Grid(2, 2).mp_groups() == [[0, 1], [2, 3]]
    return traces


def test_cnn_gpipe_grid_trains_like_one_process_and_its_trace_draws_the_grid(tmp_path):
    model = _model("cnn")
    expected = _single_process(model, dp=2)
    strategy = HybridStrategy(chunks=2, trace_dir=str(tmp_path / "trace"))
    saver = ModelCheckpoint(dirpath=tmp_path, filename="hybrid", enable_version_counter=False)
    _trainer(strategy, 4, callbacks=[saver], precision=PRECISION).fit(model, _loader(dp=2))
    assert isinstance(model.net, nn.Sequential)  # the full model came back from the ranks
    _assert_same_weights(model.state_dict(), expected)

    traces = _assert_grid_traffic(tmp_path / "trace")
    grid = Grid(2, 2)
    assert {"act", "grad"} <= {m.tag for t in traces for m in t.messages}
    assert all("bucket 0" in {e.name for e in t.events} for t in traces)
    # each rank's ring bytes: its stage's buckets (gradients and one flag per parameter,
    # float64), ring-allreduced over 2 replicas once per step, as the cost model says
    stages = split_sequential(_model("cnn").net, balance_by_params(_model("cnn").net, 2))
    for trace in traces:
        dp_rank, stage = grid.coords(trace.rank)
        params = list(reversed(list(stages[stage].parameters())))
        numels = [sum(p.numel() + 1 for p in b.params) for b in make_buckets(params, 4 << 20)]
        per_step = sum(ring_cost(n, 2, element_size=8).bytes_sent[dp_rank] for n in numels)
        sent = sum(m.nbytes for m in trace.messages if m.op == "send" and m.tag in RING_TAGS)
        assert sent == STEPS * per_step > 0
    # all of a step's bytes (but the one-off shape headers and the checkpoint) as the
    # hybrid cost model predicts them for the compare report
    predicted = hybrid_bytes(_model("cnn"), 4, GLOBAL_BATCH, {})
    once = ("header", "size", "state")
    for trace in traces:
        sent = sum(m.nbytes for m in trace.messages if m.op == "send" and m.tag not in once)
        assert sent == STEPS * predicted[trace.rank] * 2  # float64: twice float32's bytes

    # the checkpoint holds the full model and loads without the strategy
    loaded = CifarCNN.load_from_checkpoint(tmp_path / "hybrid.ckpt")
    _assert_same_weights(loaded.state_dict(), expected)
    ckpt = torch.load(tmp_path / "hybrid.ckpt", weights_only=False)
    assert ckpt["state_dict"]["net.0.0.weight"].dtype == torch.float64
    _assert_same_weights(ckpt["state_dict"], expected)
    # ... and the optimiser state of every stage, in one process's format
    assert len(ckpt["optimizer_states"][0]["state"]) == len(list(model.parameters()))


@pytest.mark.parametrize(
    "kind, options, cls",
    [
        ("rnn", {"mp_kind": "layerwise", "time_chunk": 8}, WavefrontSplit),  # the wavefront
        ("rnn", {"mp_kind": "tensor_parallel"}, TensorParallelSplit),  # LSTM units
        ("cnn", {"mp_kind": "tensor_parallel"}, TensorParallelSplit),
    ],
)
def test_other_model_parallel_kinds_train_like_one_process(tmp_path, kind, options, cls):
    model = _model(kind)
    expected = _single_process(model, dp=2)
    saver = ModelCheckpoint(dirpath=tmp_path, filename="hybrid", enable_version_counter=False)
    strategy = HybridStrategy(**options, trace_dir=str(tmp_path / "trace"))
    trainer = _trainer(strategy, 4, callbacks=[saver], precision=PRECISION)
    trainer.fit(model, _loader(dp=2))
    assert type(trainer.strategy.splitter) is cls
    _assert_same_weights(model.state_dict(), expected)
    _assert_grid_traffic(tmp_path / "trace")
    # the checkpoint holds the full model, however it was cut
    ckpt = torch.load(tmp_path / "hybrid.ckpt", weights_only=False)
    _assert_same_weights(ckpt["state_dict"], expected)


@pytest.mark.parametrize("mp_kind", ["tensor_parallel", "gpipe"])
def test_clipping_by_norm_uses_one_replicas_norm(mp_kind):
    """Every replica holds the same averaged gradient: the norm is one replica's (its row's
    slices or stages summed), not the sum over the whole grid, which would clip less."""
    model = _model("cnn")
    clip = {"gradient_clip_val": 0.05}
    expected = _single_process(model, dp=2, **clip)
    strategy = HybridStrategy(mp_kind=mp_kind)
    _trainer(strategy, 4, precision=PRECISION, **clip).fit(model, _loader(dp=2))
    _assert_same_weights(model.state_dict(), expected)


def test_four_stage_rows_and_four_replica_columns_train_like_one_process():
    """The grid's degenerate shapes: one replica of 4 stages under 1F1B, and 4 replicas of
    one stage (data parallelism alone)."""
    for dp, mp, options in [(1, 4, {"chunks": 2, "schedule": "1f1b"}), (4, 1, {"chunks": 1})]:
        model = _model("cnn")
        expected = _single_process(model, dp=dp)
        strategy = HybridStrategy(dp=dp, mp=mp, **options)
        _trainer(strategy, 4, precision=PRECISION).fit(model, _loader(dp=dp))
        _assert_same_weights(model.state_dict(), expected)
