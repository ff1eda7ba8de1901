"""A lost rank's replacement joining a running fault-tolerant fit
(:mod:`lightning_par.launch.joining`, :mod:`lightning_par.components.rejoin`,
:mod:`lightning_par.strategies._joiner`).

The agreements are tested in one process over a real store, with threads as members; the
product (a replacement started by torchrun's restart, joining with the state of a healthy
peer and ending with one process's weights) in ``test_fault_tolerance_launchers.py``."""

from __future__ import annotations

import re
import sys
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_par.components.fault_tolerance import FaultTolerance
from lightning_par.components.rejoin import admit, places_for
from lightning_par.launch import joining
from lightning_par.launch.joining import FITTING_KEY, Admission, NotAdmitted
from lightning_par.launch.membership import COMMIT, REDO, Membership
from lightning_par.launch.store_host import StoreHost
from lightning_par.strategies._joiner import ResumedSampler, resume_at

sys.path.insert(0, str(Path(__file__).parent))
from test_fault_tolerance import _together  # noqa: E402


def _client(host: StoreHost) -> dist.Store:
    store = dist.TCPStore("127.0.0.1", host.port, is_master=False, wait_for_workers=False)
    return dist.PrefixStore("test", store)


def _two_of_three(
    host: StoreHost, limit_s: float = 10.0, fit: int = 1
) -> tuple[Membership, Membership]:
    """Members 0 and 1 of a fit of three (the script's fault-tolerant fit number ``fit``)
    that lost member 2 and went on."""
    a, b, c = (Membership(_client(host), r, [0, 1, 2], limit_s) for r in range(3))
    joining.fit_begins(a.store, fit)
    assert a.store.check([FITTING_KEY])  # (see below: an answered call orders the set)
    c.declare_dead(2)
    assert _together([partial(m.settle, 0) for m in (a, b)]) == [REDO] * 2
    assert _together([a.regroup, b.regroup]) == [[0, 1]] * 2
    return a, b


def test_a_replacement_is_admitted_at_a_step_boundary_into_the_lost_members_place():
    host = StoreHost()
    try:
        a, b = _two_of_three(host)
        store = _client(host)
        name = joining.ask(store, place=2)
        assert name == 3  # (named after the first members)
        # the last member to count itself into a step lists it: every member reads the same
        assert _together([partial(m.settle, 0) for m in (a, b)]) == [COMMIT] * 2
        assert a.joining(0) == b.joining(0) == [3]
        # the leader offers the state; the replacement takes its admission and the state
        admission = Admission(2, [0, 1, 3], [0, 1, 2], [2], {3: 2}, 0, 1, {"stepped": 1})
        joining.offer(a.store, name, admission, b"state")
        got, state = joining.await_admission(store, name, limit_s=10)
        assert (got, state) == (admission, b"state")
        joiner = Membership(store, name, got.members, 10.0)
        joiner.generation = 1
        agreed = _together([partial(a.regroup, {3: 2}), partial(b.regroup, {3: 2}),
                            partial(joining.enter, joiner, 2)])  # fmt: skip
        assert agreed == [[0, 1, 3]] * 3
        assert (a.places, a.lost, joiner.rank, joiner.generation) == ({3: 2}, [2], 2, 2)
        # a member now: it counts into the next step, and nobody is listed again
        assert _together([partial(m.settle, 1) for m in (a, b, joiner)]) == [COMMIT] * 3
        assert a.joining(1) == []
    finally:
        host.close()


def test_a_replacement_is_turned_away_with_the_reason_and_the_members_go_on():
    host = StoreHost()
    try:
        store = _client(host)
        with pytest.raises(NotAdmitted, match="no fault-tolerant fit of the job is running"):
            joining.ask(store, place=1)
        a, b = _two_of_three(host, limit_s=0.5)
        late = joining.ask(store, place=2)
        joining.fit_ends(a.store)  # the fit ends before any step lists it
        with pytest.raises(NotAdmitted, match="the fit ended before the members admitted it"):
            joining.await_admission(store, late, limit_s=10)
        with pytest.raises(NotAdmitted, match="no fault-tolerant fit of the job is running"):
            joining.ask(store, place=2)
        joining.fit_begins(a.store, 1)
        # (TCPStore's set is not answered: a call that is orders it before the next client's)
        assert a.store.check([FITTING_KEY])
        slow = joining.ask(store, place=2)
        assert _together([partial(m.settle, 0) for m in (a, b)]) == [COMMIT] * 2
        assert a.joining(0) == [slow]  # (the one turned away is not listed)
        # admitted, but never ready: the members go on without it after their limit
        assert _together([partial(a.regroup, {slow: 2}), partial(b.regroup, {slow: 2})]) == [
            [0, 1]
        ] * 2  # fmt: skip
        joiner = Membership(store, slow, [0, 1, slow], 0.5)
        with pytest.raises(NotAdmitted, match="it was not ready within 0.5 s"):
            joining.enter(joiner, a.generation)
    finally:
        host.close()


def test_a_replacement_joins_only_the_fit_of_the_script_it_reached():
    """A replacement runs the script from its start: its first fault-tolerant fit may not
    join the members' second (another model, other data), whether it asks then, or asked as
    the first one ended and looks again, or is listed by the members in the second."""
    host = StoreHost()
    try:
        a, b = _two_of_three(host, limit_s=2.0)  # at the script's first fit
        store = _client(host)
        listed, looking = (joining.ask(store, place=2) for _ in range(2))
        joining.fit_ends(a.store)
        joining.fit_begins(a.store, 2)  # the script's next fault-tolerant fit
        assert joining.running_fit(a.store) == 2  # (answered: orders the sets before store's)
        assert joining.running_fit(store) == 2
        reason = re.escape(
            "the members run fault-tolerant fit 2 of the script, this process reached fit 1 "
            "(a replacement runs the script from its start and can join only the fit it "
            "reaches: the first)"
        )
        with pytest.raises(NotAdmitted, match=reason):
            joining.ask(store, place=2)  # (a replacement's first fit: fit 1)
        with pytest.raises(NotAdmitted, match="the fit ended before the members admitted it"):
            joining.await_admission(store, looking, limit_s=10)
        # the members list the one that has not looked again: they turn it away
        assert _together([partial(m.settle, 0) for m in (a, b)]) == [COMMIT] * 2
        assert a.joining(0) == [listed]
        tolerance = FaultTolerance()  # member 0's
        tolerance.membership, tolerance.fit_members = a, [0, 1, 2]
        tolerance.fit_number, tolerance.joining = 2, a.joining(0)
        offered: list[int] = []
        assert admit(tolerance, lambda: offered.append(1), step=1) == []
        assert offered == [] and a.members == [0, 1]  # no state sent, nobody waited for
        with pytest.raises(NotAdmitted, match=reason):
            joining.await_admission(store, listed, limit_s=10)
    finally:
        host.close()


def test_a_member_numbers_the_fault_tolerant_fits_of_its_process():
    """Every member runs the same script, so all number its fits alike: counted in the
    process, whichever strategy runs them; the number of the running one is in the store."""
    host = StoreHost()
    try:
        member = FaultTolerance()
        member.membership = Membership(_client(host), 0, [0, 1], 10.0)
        # (the member's own client: TCPStore's set is not answered, so another client's
        # read could reach the store before it; CI saw 0 so)
        store = member.membership.store
        member.begin_fit()
        first = member.fit_number
        assert first >= 1 and joining.running_fit(store) == first
        member.end_fit()
        assert joining.running_fit(store) == 0
        member.begin_fit()
        assert member.fit_number == joining.running_fit(store) == first + 1
        another = FaultTolerance()  # (a new strategy's, in the same process)
        another.membership = member.membership
        another.begin_fit()
        assert another.fit_number == joining.running_fit(store) == first + 2
    finally:
        host.close()


def test_a_replacement_takes_back_its_places_shard_from_the_stand_in():
    tolerance = FaultTolerance()
    tolerance.fit_members = [0, 1, 2, 3]
    asked = {4: 3, 5: 1, 6: None}
    tolerance.membership = SimpleNamespace(
        members=[0, 2], me=0, lost=[1, 3], rank=0, places={}, asked_place=asked.get
    )
    assert tolerance.stands_in_for() == [1]  # 1 -> member 0, 3 -> member 2
    # the place asked for if free, else the first free one; none left: turned away
    assert places_for(tolerance, [4, 5, 6]) == {4: 3, 5: 1, 6: None}
    tolerance.membership.members, tolerance.membership.places = [0, 2, 4], {4: 3}
    assert tolerance.lost == [1] and tolerance.stands_in_for() == [1]
    assert tolerance.loss_scale == pytest.approx(3 / 4)
    tolerance.membership.me, tolerance.membership.rank = 4, 2
    first = {"num_replicas": 4, "rank": 1}  # (what Lightning derives from RANK)
    assert tolerance.stands_in_for() == []
    # the replacement's training loader reads its place's shard of the fit's batch; a
    # validation loader shards over the members there are
    assert tolerance.sampler_kwargs(first, training=True) == {"num_replicas": 4, "rank": 3}
    assert tolerance.sampler_kwargs(first) == {"num_replicas": 3, "rank": 2}


def test_a_replacements_loader_reads_its_shard_on_from_the_members_batch():
    data = TensorDataset(torch.arange(60))
    loader = DataLoader(data, batch_size=4, sampler=DistributedSampler(data, 3, 1, seed=5))
    plain = DistributedSampler(data, 3, 1, seed=5)
    plain.set_epoch(1)
    epoch_1 = list(DataLoader(data, batch_size=4, sampler=plain))
    resume_at(loader, epoch=1, batch=2)
    assert isinstance(loader.sampler, ResumedSampler) and len(loader) == 5  # (full length)
    assert [b[0].tolist() for b in loader] == [b[0].tolist() for b in epoch_1[2:]]
    loader.sampler.set_epoch(2)  # the next epoch is read whole
    plain.set_epoch(2)
    assert [b[0].tolist() for b in loader] == [s[0].tolist() for s in DataLoader(
        data, batch_size=4, sampler=plain)]  # fmt: skip
    with pytest.raises(ValueError, match="one DataLoader over Lightning's DistributedSampler"):
        resume_at(DataLoader(data, batch_size=4), epoch=0, batch=1)
