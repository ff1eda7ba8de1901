"""The stacked-RNN wavefront without Lightning: the schedule as pure functions, weights
after k steps equal to one process, and the configurations it refuses."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_par.comm import CommTrace, Communicator, run_on_ranks
from lightning_par.modelparallel import (
    WavefrontSequential,
    recurrent_parts,
    stacked_rnn,
    time_chunk_sizes,
    train_step,
    wavefront_balance,
    wavefront_grid,
    wavefront_steps,
    wavefront_utilisation,
)
from lightning_par.pipeline.timeline import measured_bubble

SEQ, FEATURES, HIDDEN, STEPS = 7, 5, 6, 3


class Head(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.fc = nn.Linear(hidden, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x[:, -1])


def _net(kind: str, layers: int) -> nn.Sequential:
    torch.manual_seed(0)
    net = stacked_rnn(kind, [FEATURES] + [HIDDEN] * layers)
    net.append(Head(HIDDEN))
    return net


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(4, SEQ, FEATURES, generator=g), torch.randint(0, 3, (4,), generator=g)


def _stage(rank, world, kind, layers, balance, time_chunk, trace):
    net = _net(kind, layers)
    comm = Communicator(trace=CommTrace(rank=rank) if trace else None)
    piped = WavefrontSequential(net, balance, comm, time_chunk)
    opt = torch.optim.Adam(piped.parameters(), lr=0.05)
    x, y = _data()
    for _ in range(STEPS):
        opt.zero_grad()
        train_step(piped, x, y, nn.functional.cross_entropy)
        opt.step()
    # numpy copies travel back by value, not as shared-memory handles
    state = {k: v.detach().numpy().copy() for k, v in piped.state_dict().items()}
    return state, comm.trace


def _single(kind: str, layers: int) -> dict[str, torch.Tensor]:
    net = _net(kind, layers)
    opt = torch.optim.Adam(net.parameters(), lr=0.05)
    x, y = _data()
    for _ in range(STEPS):
        opt.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
    return net.state_dict()


@pytest.mark.parametrize(
    "kind, layers, balance, time_chunk",
    [
        ("lstm", 2, [1, 2], 3),  # 7 steps = 3 + 3 + 1
        ("gru", 2, [1, 2], 1),  # the slides' picture: one step per message
        ("lstm", 3, [2, 2], None),  # the naive split: one chunk of the whole sequence
        ("gru", 3, [1, 1, 2], 3),
        ("lstm", 4, [1, 1, 1, 2], 1),
        ("gru", 4, [2, 1, 2], None),
        ("lstm", 4, [1, 2, 2], 3),
    ],
)
def test_weights_equal_single_process(kind, layers, balance, time_chunk):
    expected = _single(kind, layers)
    results = run_on_ranks(_stage, len(balance), kind, layers, balance, time_chunk, False,
                           timeout=60)  # fmt: skip
    got = {}
    for state, _ in results:
        assert not set(got) & set(state), "stages must hold disjoint layers"
        got.update(state)
    assert got.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(
            torch.from_numpy(got[name]), expected[name], rtol=1e-5, atol=1e-6
        )


def test_trace_shows_wavefront_per_chunk():
    results = run_on_ranks(_stage, 2, "lstm", 2, [1, 2], 3, True, timeout=60)
    traces = [trace for _, trace in results]
    chunks = len(time_chunk_sizes(SEQ, 3))
    for trace in traces:
        for op in ("fwd", "bwd"):
            spans = [e.micro_batch for e in trace.events if e.name == op]
            assert sorted(spans) == sorted(list(range(chunks)) * STEPS)
    # stage 0 sends each chunk's output forward, stage 1 each chunk's input gradient back
    acts = [m for m in traces[0].messages if m.tag == "act" and m.op == "send"]
    grads = [m for m in traces[1].messages if m.tag == "grad" and m.op == "send"]
    assert len(acts) == len(grads) == chunks * STEPS
    # activations go forward in time order, gradients back in reverse, each carrying its
    # chunk: 4 sequences x (3, 3, 1) steps x HIDDEN floats
    sizes = time_chunk_sizes(SEQ, 3)
    assert [m.chunk for m in acts] == list(range(chunks)) * STEPS
    assert [m.chunk for m in grads] == list(reversed(range(chunks))) * STEPS
    for m in acts + grads:
        assert m.nbytes == 4 * sizes[m.chunk] * HIDDEN * 4, m
    # the second stage's first forward of a step starts after the first stage's first one
    first = {t.rank: min(e.start + t.origin for e in t.events if e.name == "fwd") for t in traces}
    assert first[1] > first[0]
    # each chunk waits only for its own activation: stage 1's forward of chunk c starts
    # after stage 0's forward of chunk c ended (the dependency the trace must show)
    for step_events_ in zip(*[_forwards(t) for t in traces]):
        (c0, _, end0), (c1, start1, _) = step_events_
        assert c0 == c1 and start1 >= end0, step_events_


def _forwards(trace: CommTrace) -> list[tuple[int, float, float]]:
    """(chunk, start, end) of every forward span, on the shared clock, in time order."""
    spans = [e for e in trace.events if e.name == "fwd"]
    return sorted(((e.micro_batch, trace.origin + e.start, trace.origin + e.end) for e in spans),
                  key=lambda s: s[1])  # fmt: skip


def test_naive_split_measures_at_least_half_idle():
    # Without time chunks one stage works at a time, so the measured bubble of a step is at
    # least 1 - 1/K = 1/2 (what the wavefront is there to cut).
    results = run_on_ranks(_stage, 2, "lstm", 2, [1, 2], None, True, timeout=60)
    traces = [trace for _, trace in results]
    for step in range(STEPS):
        assert measured_bubble(traces, step) >= 0.5 - 0.02, step


def test_schedule_pure_functions():
    assert time_chunk_sizes(7, 3) == [3, 3, 1]
    assert time_chunk_sizes(7, None) == [7]
    assert time_chunk_sizes(4, 8) == [4]
    grid = wavefront_grid(3, 4)
    assert len(grid) == 4 + 3 - 1
    assert grid[0] == [0, None, None]  # one device active
    assert grid[1] == [1, 0, None]  # then two
    assert grid[2] == [2, 1, 0]  # then all of them
    busy = sum(c is not None for row in grid for c in row)
    assert busy / (len(grid) * 3) == pytest.approx(wavefront_utilisation(3, 4))
    steps = wavefront_steps(2, 3)[1]
    assert [str(s) for s in steps] == ["F0", "F1", "F2", "B2", "B1", "B0"]
    with pytest.raises(ValueError, match="time_chunk must be >= 1"):
        time_chunk_sizes(5, 0)


def test_balance_keeps_ends_with_recurrent_stages():
    net = nn.Sequential(nn.Flatten(2), *_net("lstm", 3))
    balance = wavefront_balance(net, 3)
    assert balance == [2, 1, 2]
    assert [(a, b) for a, b, _ in recurrent_parts(net, balance)] == [(1, 2), (2, 3), (3, 4)]


def test_bad_configurations():
    net = _net("lstm", 2)
    with pytest.raises(ValueError, match="only 2 recurrent layers"):
        recurrent_parts(net, [1, 1, 1])
    with pytest.raises(ValueError, match="no recurrent layer"):
        recurrent_parts(_net("gru", 3), [3, 1])  # the head alone
    bi = nn.Sequential(nn.LSTM(4, 4, batch_first=True, bidirectional=True), nn.Identity())
    with pytest.raises(ValueError, match="bidirectional"):
        recurrent_parts(bi, [1, 1])
    time_major = nn.Sequential(nn.GRU(4, 4), nn.Identity())
    with pytest.raises(ValueError, match="batch_first"):
        recurrent_parts(time_major, [1, 1])

    class Opaque(nn.Module):  # wraps an LSTM without a way to pass its state in
        def __init__(self):
            super().__init__()
            self.lstm = nn.LSTM(4, 4, batch_first=True)

        def forward(self, x):
            return self.lstm(x)[0]

    with pytest.raises(ValueError, match="cannot be carried"):
        recurrent_parts(nn.Sequential(Opaque(), Opaque()), [1, 1])
    gap = nn.Sequential(*_net("lstm", 1)[:1], nn.ReLU(), *_net("lstm", 1)[:1])
    with pytest.raises(ValueError, match="between recurrent layers"):
        recurrent_parts(gap, [1, 2])
