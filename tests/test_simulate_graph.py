"""Traces to graphs on hand-made two-rank traces (times in seconds, one clock)."""

from __future__ import annotations

import pytest

from lightning_par.comm.trace import CommTrace, Event, Message
from lightning_par.simulate.engine import simulate
from lightning_par.simulate.graph import build_graph, match, transfer_samples
from lightning_par.simulate.links import Link, Topology
from lightning_par.simulate.ops import Join

RUN_LINK = Link("run", alpha=6.0, beta=0.0)


def overlapped_rank(rank: int) -> CommTrace:
    """Backward 0-10; its bucket is exchanged on the communication thread from 6 (posted
    inside ``bucket 0``), and the main thread waits for it from 10 to 12; the step ends at 13."""
    peer = 1 - rank
    t = CommTrace(rank=rank, origin=0.0)
    t.events = [Event(rank, "backward", 0.0, 10.0), Event(rank, "bucket 0", 6.0, 12.0),
                Event(rank, "wait for buckets", 10.0, 12.0)]  # fmt: skip
    t.messages = [Message(rank, "send", peer, 100, 6.0, 12.0, wait_start=6.0),
                  Message(rank, "recv", peer, 100, 6.0, 12.0, wait_start=6.0)]  # fmt: skip
    return t


def test_background_messages_overlap_backward_and_the_wait_joins_them():
    traces = [overlapped_rank(0), overlapped_rank(1)]
    windows = {0: [(0.0, 13.0)], 1: [(0.0, 13.0)]}
    graph = build_graph(traces, RUN_LINK, windows)
    assert (0, "bg") in graph.lanes and any(isinstance(op, Join) for op in graph.lanes[(0, "main")])
    # on the run's own link (6 s per message) the replay is the measured step
    same = simulate(graph, Topology(RUN_LINK, RUN_LINK))
    assert same.end == {0: pytest.approx(13.0), 1: pytest.approx(13.0)}
    # free messages: the exchange ends at 6, under backward; the 2 s wait disappears
    free = Link("free", 0.0, 0.0)
    fast = simulate(graph, Topology(free, free))
    assert fast.end[0] == pytest.approx(11.0)
    assert fast.split[0] == pytest.approx({"compute": 11.0, "communication": 0.0, "waiting": 0.0})
    # a twice faster device halves compute; the exchange (posted at 3) still takes 6 s
    assert simulate(graph, Topology(RUN_LINK, RUN_LINK), speed=2.0).end[0] == pytest.approx(9.5)


def test_sends_match_receives_in_post_order_and_give_transfer_samples():
    a, b = CommTrace(rank=0, origin=0.0), CommTrace(rank=1, origin=0.0)
    a.messages = [Message(0, "send", 1, 10, 0.0, 1.0), Message(0, "send", 1, 20, 2.0, 4.0)]
    b.messages = [Message(1, "recv", 0, 10, 0.5, 1.5, wait_start=0.5),
                  Message(1, "recv", 0, 20, 1.0, 5.0, wait_start=1.0)]  # fmt: skip
    assert match([a, b]) == {(0, 0): (1, 0), (1, 0): (0, 0), (0, 1): (1, 1), (1, 1): (0, 1)}
    # the receiver was blocked before both ends were posted: arrival - max(posts)
    assert sorted(transfer_samples([a, b])) == [(10, 1.0), (20, 3.0)]


def test_a_message_to_an_untraced_peer_keeps_its_measured_time():
    t = CommTrace(rank=0, origin=0.0)
    t.messages = [Message(0, "send", 5, 1000, 1.0, 4.0, wait_start=1.0)]  # rank 5: a server
    graph = build_graph([t], Link("l", 1.0, 0.0))
    assert graph.messages[0].one_sided and graph.messages[0].extra_s == pytest.approx(2.0)
    same = Topology(Link("l", 1.0, 0.0), Link("l", 1.0, 0.0))
    assert simulate(graph, same).step_s(0) == pytest.approx(3.0)  # posted at 1, done at 4
    slower = Topology(Link("l", 5.0, 0.0), Link("l", 5.0, 0.0))
    assert simulate(graph, slower).step_s(0) == pytest.approx(7.0)  # the server's 2 s stay


def test_a_pull_waited_for_after_the_replayed_steps_adds_nothing_to_them():
    # a parameter server's worker: its last step (0-10) posts a pull at 8 on the bucket
    # thread, and the pull is only waited for at 25, when training ends
    t = CommTrace(rank=0, origin=0.0)
    t.events = [Event(0, "backward", 0.0, 6.0), Event(0, "bucket 0", 7.0, 9.0)]
    t.messages = [Message(0, "recv", 5, 1000, 8.0, 26.0, wait_start=25.0)]  # rank 5: a server
    graph = build_graph([t], Link("l", 1.0, 0.0), {0: [(0.0, 10.0)]})
    same = Topology(Link("l", 1.0, 0.0), Link("l", 1.0, 0.0))
    # the step is its window, not the window and the wait for what comes after it
    assert simulate(graph, same).step_s(0) == pytest.approx(10.0)
