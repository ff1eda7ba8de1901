"""The parameter-server protocol: one header layout for every command, one tag per message
kind, a message of the wrong kind or layout refused by name, the client plan as data."""

from __future__ import annotations

import pytest
import torch

from lightning_par.comm import CommTrace, Communicator, run_on_ranks
from lightning_par.paramserver import Command, Header, Kind, ProtocolError, plan_client
from lightning_par.paramserver.messages import recv_header, send_headers
from lightning_par.paramserver.protocol import (
    MAGIC,
    NONE,
    Info,
    decode_info,
    decode_push,
    decode_work,
    encode_info,
    encode_push,
    encode_work,
    header_size,
)


@pytest.mark.parametrize("command", list(Command))
@pytest.mark.parametrize("hyper", [(), (0.1,), (1e-3, 0.9, 0.999, 1e-8, 0.0, 1 / 3)])
def test_header_round_trip_for_every_command(command, hyper):
    header = Header(command, step=123456, hyper=hyper, trained=(7, 41), count=99)
    message = header.encode()
    assert message.dtype == torch.float64 and message.numel() == header_size(len(hyper))
    assert Header.decode(message, len(hyper)) == header  # float64: every number exact
    plain = Header(command)
    assert Header.decode(plain.encode(), 0) == plain
    assert plain.trained == (NONE, NONE) and plain.count == NONE


def test_commands_and_kinds_are_distinct_and_named():
    assert len({int(c) for c in Command}) == len(Command)
    tags = [int(k) for k in Kind]
    assert len(set(tags)) == len(Kind) and min(tags) > 0  # tag 0: every other plugin
    assert {k.name.lower() for k in Kind} >= {"header", "push", "pull", "init", "object"}


def test_a_message_of_another_kind_is_refused_not_misread():
    # a push (gradient floats) received where a header was expected
    push = encode_push([torch.randn(5)], [torch.tensor(1.0)]).double()
    with pytest.raises(ProtocolError, match="not a parameter-server header"):
        Header.decode(torch.cat([push, torch.zeros(header_size(2) - push.numel())]), 2)
    # the old synchronous layout [command, step, *hyper], zero-padded as gloo leaves it
    old = torch.tensor([1.0, 3.0, 0.1, 0.9, 0.0, 0.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    with pytest.raises(ProtocolError, match="not a parameter-server header"):
        Header.decode(old, 2)


def test_a_header_of_another_layout_is_refused():
    short = Header(Command.STEP, 1, (0.1,)).encode()  # one hyperparameter
    padded = torch.cat([short, torch.zeros(1, dtype=torch.float64)])  # as received into 2
    with pytest.raises(ProtocolError, match="carrying 1 hyperparameters.*expects 9 carrying 2"):
        Header.decode(padded, 2)
    with pytest.raises(ProtocolError, match="expects"):
        Header.decode(Header(Command.STEP, 1, (0.1, 0.2, 0.3)).encode(), 2)
    unknown = Header(Command.STEP).encode()
    unknown[1] = 42
    with pytest.raises(ProtocolError, match="unknown command 42.0"):
        Header.decode(unknown, 0)
    with pytest.raises(ProtocolError, match="float64"):
        Header.decode(Header(Command.STOP).encode().float(), 0)


def test_communicator_tags():
    from lightning_par.comm.p2p import tag_label, transport_tag

    assert (tag_label(Kind.PUSH), transport_tag(Kind.PUSH)) == ("push", int(Kind.PUSH))
    assert (tag_label("act"), transport_tag("act")) == ("act", 0)  # a label only
    assert (tag_label(9), transport_tag(9)) == ("9", 9)
    with pytest.raises(ValueError, match=">= 0"):
        transport_tag(-1)


def test_payload_layouts():
    message = encode_push([torch.arange(3.0), torch.arange(2.0)], [torch.tensor(1.0)] * 2)
    grad, used = decode_push(message, 5, 2)
    assert grad.tolist() == [0, 1, 2, 0, 1] and used.tolist() == [True, True]
    assert decode_info(encode_info(Info(2, 1, 9))) == Info(2, 1, 9)
    assert encode_work(3, NONE).dtype == torch.int64
    assert decode_work(encode_work(3, NONE)) == (3, NONE)


def _out_of_order(rank, world_size):
    """Rank 0 posts a push, then a header; rank 1 takes the header first: receives match by
    kind, not by the order the messages were posted (under one tag for all, rank 1 would
    read the push as its header)."""
    comm = Communicator(trace=CommTrace(rank))
    header = Header(Command.STEP, 5, (0.25,), (1, 2), NONE)
    if rank == 0:
        push = comm.isend(torch.arange(4.0), 1, tag=Kind.PUSH)
        send_headers(comm, [1], header)  # completes before the push is taken
        push.wait()
        return None
    got = recv_header(comm, 0, 1)
    push = comm.recv(torch.empty(4), 0, tag=Kind.PUSH)
    labels = [m.tag for m in comm.trace.messages]
    return got == header, push.tolist(), labels


def test_receives_match_by_kind_across_processes():
    _, (same, push, labels) = run_on_ranks(_out_of_order, 2, timeout=20)
    assert same and push == [0.0, 1.0, 2.0, 3.0]
    assert labels == ["header", "push"]  # the trace names each message's kind


def _wrong_layout(rank, world_size):
    comm = Communicator()
    if rank == 0:  # a header with no hyperparameters, to a server expecting two
        send_headers(comm, [1], Header(Command.STEP, 1))
        return None
    try:
        recv_header(comm, 0, 2)
    except ProtocolError as err:
        return str(err)
    return "read without error"


def test_a_header_of_the_wrong_layout_is_refused_across_processes():
    _, message = run_on_ranks(_wrong_layout, 2, timeout=20)
    assert "worker 0 (rank 0)" in message and "carrying 0 hyperparameters" in message


def test_client_plan_is_a_pure_function_of_sizes_and_servers():
    # three parameters in two buckets (backward order: the last layer first), two servers;
    # parameter 2 (4 KiB) is split over both servers
    plan = plan_client([1024, 10, 3], [4, 4, 4], [[2, 1], [0]], 2, split_bytes=1000)
    assert plan.buckets == ((2, 1), (0,))
    assert [pc.server for pc in plan.shards.of_param(0)] == [0, 1]
    for b, members in enumerate(plan.buckets):
        assert sum(plan.numel(b, s) for s in range(2)) == sum([1024, 10, 3][i] for i in members)
        for s in plan.servers_of(b):
            assert all(members[pos] == pc.param and pc.server == s
                       for pos, pc in plan.slices[b][s])  # fmt: skip
    assert plan.servers_of(1) == [0, 1]
    assert plan.buckets_of([0]) == [1] and plan.buckets_of([1, 2]) == [0]
    with pytest.raises(ValueError, match="exactly once"):
        plan_client([1, 2], [4, 4], [[0]], 1)
    assert MAGIC == float(int(MAGIC))  # exact in float64 and float32


def _bad_header_to_a_server(rank, world_size, asynchronous):
    """Workers 0 and 1, server rank 2; worker 1 sends a header of the old synchronous
    layout (no magic number), zero-padded to the new length."""
    import time

    from torch import nn

    from lightning_par.paramserver import AsyncParameterClient, ParameterClient, serve, serve_async
    from lightning_par.paramserver.protocol import header_size

    comm = Communicator()
    if rank == 2:
        if asynchronous:
            serve_async(comm, 0, None)
        else:
            serve(comm, 0)
        return "served without error"
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cls = AsyncParameterClient if asynchronous else ParameterClient
    client = cls(model, opt, comm, 2, 1)
    if rank == 1:
        old = torch.zeros(header_size(len(client.lrs())), dtype=torch.float64)
        old[:2] = torch.tensor([1.0, 0.0])  # [STEP, step 0, ...]
        comm.send(old, 2, tag=Kind.HEADER)
    else:  # a good header (the synchronous server reads worker 0's first)
        send_headers(comm, [2], client.header(Command.STEP))
    time.sleep(60)  # stopped when the server fails


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_server_refuses_a_header_of_another_layout(asynchronous):
    from lightning_par.comm import RankFailed

    with pytest.raises(RankFailed) as err:
        run_on_ranks(_bad_header_to_a_server, 3, asynchronous, timeout=20)
    message = str(err.value)
    assert "rank 2 of 3 raised" in message and "ProtocolError" in message, message
    assert "from worker 1 (rank 1) is not a parameter-server header" in message, message
    assert "dropped worker" not in message  # a bug is not taken for a lost worker
