"""The simulator's engine on hand-built graphs whose step times can be worked out by hand."""

from __future__ import annotations

import pytest

from lightning_par.simulate.engine import simulate
from lightning_par.simulate.links import Link, Topology, parse_topology
from lightning_par.simulate.ops import After, Compute, Graph, Join, Msg, Post, Wait

LINK = Link("test", alpha=1.0, beta=0.5)  # 1 s per message, 2 bytes per second
FLAT = Topology(LINK, LINK)


def ping(compute0: float, compute1: float, nbytes: int = 4) -> Graph:
    """Rank 0 computes, then sends ``nbytes`` to rank 1, which computes, then receives."""
    g = Graph()
    m = g.message(Msg(0, 1, nbytes))
    g.lane(0).extend([Compute(compute0), Post(m), Wait(m)])
    g.lane(1).extend([Compute(compute1), Post(m), Wait(m)])
    return g


def test_message_starts_when_both_ends_are_posted():
    r = simulate(ping(2.0, 5.0), FLAT)
    # both posted at 5 (rank 1 is late), 1 + 0.5 * 4 = 3 s on the wire: both done at 8
    assert r.end == {0: pytest.approx(8.0), 1: pytest.approx(8.0)}
    assert r.split[0] == pytest.approx({"compute": 2.0, "communication": 3.0, "waiting": 3.0})
    assert r.split[1] == pytest.approx({"compute": 5.0, "communication": 3.0, "waiting": 0.0})


def test_link_and_speed_change_the_step():
    fast = Topology(Link("fast", 0.1, 0.0), Link("fast", 0.1, 0.0))
    r = simulate(ping(2.0, 5.0), fast, speed={0: 1.0, 1: 2.5})
    # rank 1 now computes 5 / 2.5 = 2 s: posts at 2, done at 2.1
    assert r.end[1] == pytest.approx(2.1)
    assert r.split[0]["waiting"] == pytest.approx(0.0)


def test_background_lane_overlaps_compute_and_the_join_waits_for_it():
    g = Graph()
    m = g.message(Msg(0, 1, 2, one_sided=True, extra_s=0.5))  # 0.5 + 1 + 1 = 2.5 s
    g.lane(0).extend([Compute(4.0), Compute(4.0), Join((0, "bg"), 3)])
    # the bucket is ready halfway through the second compute (t = 6)
    g.lane(0, "bg").extend([After((0, "main"), 1, 0.5), Post(m), Wait(m)])
    r = simulate(g, FLAT)
    assert r.end[0] == pytest.approx(8.5)  # 6 + 2.5: 0.5 s of it not hidden by compute
    assert r.split[0] == pytest.approx({"compute": 8.0, "communication": 0.5, "waiting": 0.0})


def test_shared_link_divides_bandwidth_between_concurrent_transfers():
    shared = Link("bus", alpha=1.0, beta=0.5, shared=True)
    g = Graph()
    for worker in (1, 2):
        m = g.message(Msg(worker, 0, 4))
        g.lane(worker).extend([Post(m), Wait(m)])
        g.lane(0).append(Post(m))
    g.lane(0).extend([Wait(0), Wait(1)])
    alone = simulate(g, Topology(LINK, LINK), contention=True)
    both = simulate(g, Topology(shared, shared), contention=True)
    assert alone.end[1] == pytest.approx(3.0)  # 1 + 0.5 * 4
    assert both.end[1] == pytest.approx(5.0)  # 1 + 2 * 0.5 * 4: two transfers share server 0


def test_deadlock_is_reported():
    g = Graph()
    m = g.message(Msg(0, 1, 1))
    g.lane(0).extend([Post(m), Wait(m)])  # rank 1 never posts its receive
    g.lane(1).append(Compute(1.0))
    with pytest.raises(RuntimeError, match="deadlocks"):
        simulate(g, FLAT)


def test_topology_picks_the_link_by_node():
    topo = parse_topology("nvlink+ib", per_node=8)
    assert topo.link(0, 7).name == "nvlink" and topo.link(7, 8).name == "ib"
    assert topo.slowest(8).name == "nvlink" and topo.slowest(9).name == "ib"
    with pytest.raises(ValueError, match="unknown link preset 'nvlnk'"):
        parse_topology("nvlnk+ib")
