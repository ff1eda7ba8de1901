"""Replicated parameter servers without Lightning (``fault_tolerant``: :mod:`~lightning_par.
paramserver.replication`, ``takeover``, ``shard_server``, ``replicated_client``): two workers
and the server processes in one gloo group, one server killed at a chosen point of the
protocol; every worker's weights and the optimiser state gathered from the servers equal a
run in which no server was lost. A lost worker too (``lost_workers``, ``missing_pushes``):
worker 0 pushes in its place and trains its batches, and its weights stay the same."""

from __future__ import annotations

import pytest
import torch
from _replicated_run import assert_same, run_replicated
from torch import nn

from lightning_par.comm import Communicator, run_on_ranks
from lightning_par.paramserver import protocol
from lightning_par.paramserver.clipping import GradClip
from lightning_par.paramserver.protocol import NONE, Kind, ShardTag
from lightning_par.paramserver.replicated_client import ReplicatedClient
from lightning_par.paramserver.replication import (
    backup_of,
    copy_held_by,
    server_processes,
)


# ---- the ring and the messages, without processes --------------------------------------------
def test_each_shard_is_copied_in_the_next_server_process_and_a_lone_server_has_a_standby():
    assert server_processes(1, True) == 2 and server_processes(1, False) == 1
    assert server_processes(3, True) == 3
    assert [backup_of(s, 3) for s in range(3)] == [1, 2, 0]
    assert [copy_held_by(p, 3, 3) for p in range(3)] == [2, 0, 1]
    assert [copy_held_by(p, 1, 2) for p in range(2)] == [None, 0]  # the standby copies 0


def test_shard_tags_are_apart_from_every_kind_and_from_each_other_and_read_as_their_kind():
    tags = {int(ShardTag(kind, s)) for kind in Kind for s in range(4)}
    assert len(tags) == 4 * len(Kind) and not tags & {int(k) for k in Kind}
    assert ShardTag(Kind.PUSH, 3).label == "push"


def test_recovery_messages_round_trip_and_refuse_another_layout():
    grad, used = torch.arange(5.0), torch.tensor([True, False])
    back, mask = protocol.decode_update(protocol.encode_update(grad, used), 5, 2)
    assert torch.equal(back, grad) and mask.tolist() == [True, False]
    assert protocol.decode_ack(protocol.encode_ack(7, NONE)) == (7, NONE)
    assert protocol.decode_count(protocol.encode_count(12), Kind.DONE) == 12
    with pytest.raises(protocol.ProtocolError, match="ACK message"):
        protocol.decode_ack(protocol.encode_count(1))


# ---- a kill at a point of the protocol (_replicated_run.py) ----------------------------------
@pytest.mark.parametrize("kill", [
    (1, "begin", 5),  # lost as a step begins: every worker sends it again (redone)
    (1, "update", 6),  # the copy applied its first bucket: not applied again
    (0, "answer", 7),  # worker 0 had its answer, worker 1 not: answered again, then redone
    (0, "copy", 5),  # lost as the copy of shard 1 mid-step: its own shard moves, 1 goes on alone
    (1, "begin", 3),  # lost as a checkpoint's read begins: read again from the copy
    (0, "begin", 4),  # lost as a checkpoint's load begins: worker 0 sends the state again
], ids=lambda k: f"server{k[0]}-{k[1]}-request{k[2]}")  # fmt: skip
def test_two_servers_one_lost_at_a_point_of_the_protocol(kill):
    reference = run_replicated(2)
    run = run_replicated(2, kill)
    assert run[1] == {kill[0]}
    assert_same(run, reference)


def test_a_lone_server_is_taken_over_by_its_standby_and_a_lost_standby_is_survived():
    reference = run_replicated(1)
    assert_same(run_replicated(1, (0, "update", 5)), reference)
    assert_same(run_replicated(1, (0, "initial", 0)), reference)  # even before the first step
    assert_same(run_replicated(1, (1, "copy", 6)), reference)


def test_clipping_by_norm_survives_a_lost_server():
    clip = GradClip(0.05, "norm")
    reference = run_replicated(2, clip=clip)
    assert_same(run_replicated(2, (1, "update", 5), clip=clip), reference)


def test_a_shard_lost_with_its_copy_ends_the_job_naming_both():
    # server 1 dies as step 2 begins, server 0 (then holding both shards) as step 3 begins
    results, said = run_replicated(2, (1, "begin", 5), (0, "begin", 6))
    assert said == {0, 1}
    for error in results.values():
        assert isinstance(error, str) and "parameter server 0 (rank 2) was killed" in error
        assert "no live process holds a copy of shard" in error, error


def _more_servers_than_tensors(rank: int, world: int) -> str:
    model = nn.Linear(2, 1)  # two tensors, three servers: one holds nothing
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        ReplicatedClient(model, opt, Communicator(), 1, 3, name="parameter_server")
    except ValueError as err:
        return str(err)
    return "accepted"


def test_a_server_without_parameters_is_refused_naming_the_option_and_the_fix():
    # (refused before any message: the servers would never be heard from at a step)
    (message,) = run_on_ranks(_more_servers_than_tensors, 1, timeout=30)
    assert message.startswith("parameter_server: fault_tolerant=True needs every server"), message
    assert "server(s) [2] hold none" in message and "lower num_servers or split_mb" in message


@pytest.mark.parametrize("worker", [1, 0])
@pytest.mark.parametrize("point", ["mid-push", "pushed"])
def test_a_lost_workers_pushes_come_from_the_leader_and_the_weights_stay_the_same(point, worker):
    """Worker 1 (or 0) dies at step 3 after pushing part of its gradient (the shards
    complete the rest from the leader, worker 0 or else 1, which computes it on the lost
    worker's batch) or all of it (the servers find it lost only at the next step, which the
    leader already trains for it): the survivor's weights and the optimiser state (read
    and loaded again after the loss: the leader sends it) equal a run with no worker lost."""
    reference = run_replicated(2)
    run = run_replicated(2, lose=(point, 3, worker))
    assert list(run[0]) == [1 - worker]
    assert_same(run, reference)
