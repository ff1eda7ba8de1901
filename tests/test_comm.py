"""The communication layer: fork runner, failures that name the rank, traced messages (the
processes behind the runner: ``test_rank_processes.py``)."""

import os
import time

import pytest
import torch

from lightning_par.comm import (
    CommError,
    CommTrace,
    Communicator,
    RankFailed,
    run_on_ranks,
)


def _ring_shift(rank, world_size):
    comm = Communicator(trace=CommTrace(rank))
    out = torch.empty(3)
    comm.sendrecv(
        torch.full((3,), float(rank)), (rank + 1) % world_size, out, (rank - 1) % world_size,
        step=0, chunk=rank,
    )  # fmt: skip
    return out.tolist(), comm.trace.totals(), [(m.op, m.peer, m.step) for m in comm.trace.messages]


def _echo(rank, world_size, extra):
    return rank, world_size, extra


# Rank functions live at module level: where fork is unsafe (a GPU machine after a backward
# pass) run_on_ranks starts them through a forkserver, which pickles them.
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_run_on_ranks_returns_results_in_rank_order(world_size):
    assert run_on_ranks(_echo, world_size, 7) == [(r, world_size, 7) for r in range(world_size)]


def test_messages_arrive_and_are_traced():
    results = run_on_ranks(_ring_shift, 3)
    for rank, (received, totals, messages) in enumerate(results):
        assert received == [float((rank - 1) % 3)] * 3
        assert totals == {"rank": rank, "messages_sent": 1, "bytes_sent": 12, "bytes_received": 12}
        assert sorted(messages) == [("recv", (rank - 1) % 3, 0), ("send", (rank + 1) % 3, 0)]


def _rank_1_raises(rank, world_size):
    if rank == 1:
        raise ValueError("boom on purpose")
    return rank


def test_raising_rank_is_named():
    with pytest.raises(RankFailed, match=r"rank 1 of 2 raised:(.|\n)*boom on purpose"):
        run_on_ranks(_rank_1_raises, 2)


def _rank_1_dies(rank, world_size):
    if rank == 1:
        os._exit(3)
    Communicator().recv(torch.empty(2), 1)


def test_dead_rank_is_named_before_its_peers_echo():
    with pytest.raises(RankFailed, match="rank 1 of 2 died with exit code 3"):
        run_on_ranks(_rank_1_dies, 2, timeout=10)


def _rank_1_hangs(rank, world_size):
    if rank == 1:
        time.sleep(3600)
    Communicator().recv(torch.empty(2), 1, step=4)


def test_hung_rank_fails_fast_with_the_peer_named():
    start = time.monotonic()
    with pytest.raises(RankFailed) as err:
        run_on_ranks(_rank_1_hangs, 2, timeout=3)
    assert time.monotonic() - start < 20
    message = str(err.value)
    # the waiting rank's own error names the silent peer and the step it waited in
    assert "rank 0 of 2 raised" in message and "CommError" in message
    assert "rank 0: recv from rank 1 failed (step 4" in message


def _ring_with_a_hung_peer(rank, world_size):
    if rank == 1:
        time.sleep(3600)
    from lightning_par.collectives import ring_allreduce

    ring_allreduce(torch.ones(8))  # untraced on CPU: posted by Communicator.post, no Handle


def test_a_ring_message_that_fails_names_its_phase_step_and_chunk():
    with pytest.raises(RankFailed) as err:
        run_on_ranks(_ring_with_a_hung_peer, 2, timeout=3)
    message = str(err.value)
    assert "CommError" in message
    assert "rank 0: recv from rank 1 failed (reduce-scatter message, step 0, chunk 1)" in message


class _ClosedConnection:
    """A process group whose every post fails, as gloo's does once a peer has gone."""

    def send(self, tensors, peer, tag):
        raise RuntimeError("[pair.cc:534] Connection closed by peer")

    recv = send


def _post_to_a_closed_connection(rank, world_size):
    comm = Communicator()
    comm._pg = _ClosedConnection()  # the group torch's messages are posted on
    errors = []
    for post in (
        lambda: comm.post(
            "send", torch.ones(2), 1 - rank, "reduce-scatter message, step 0, chunk 1"
        ),
        lambda: comm.isend(torch.ones(2), 1 - rank, step=3, chunk=2, tag="push"),
        lambda: comm.irecv(torch.ones(2), 1 - rank, step=3, chunk=2),
    ):
        with pytest.raises(CommError) as err:
            post()
        errors.append(str(err.value))
    return errors


def test_a_message_that_fails_as_it_is_posted_names_the_rank_peer_and_message():
    # gloo raises at once on posting to a peer whose connection closed: the untraced path
    # (Communicator.post, the ring's) and the traced one (isend, irecv) name it alike, and
    # as a failed wait would
    errors = run_on_ranks(_post_to_a_closed_connection, 2)[0]
    closed = "[pair.cc:534] Connection closed by peer."
    hint = "If rank 1 died or hangs, look at its own error above."
    assert errors == [
        f"rank 0: send to rank 1 failed (reduce-scatter message, step 0, chunk 1): {closed} {hint}",
        f"rank 0: send to rank 1 failed (push message, step 3, chunk 2): {closed} {hint}",
        f"rank 0: recv from rank 1 failed (step 3, chunk 2): {closed} {hint}",
    ]


def _bad_peers_refused(rank, world_size):
    comm = Communicator()
    for peer in (rank, world_size, -1):
        with pytest.raises(ValueError, match="invalid peer"):
            comm.isend(torch.zeros(1), peer)
    return True


def test_communicator_rejects_bad_peers_and_needs_a_group():
    with pytest.raises(RuntimeError, match="not initialised"):
        Communicator()
    assert run_on_ranks(_bad_peers_refused, 2) == [True, True]


def _send_empty(rank, world_size):
    comm = Communicator(trace=CommTrace(rank))
    comm.sendrecv(torch.empty(0), 1 - rank, torch.empty(0), 1 - rank)
    return comm.trace.totals()["bytes_sent"], len(comm.trace.messages)


def test_empty_tensors_are_not_sent_but_traced():
    assert run_on_ranks(_send_empty, 2) == [(0, 2), (0, 2)]


def _span_and_gather(rank, world_size):
    trace = CommTrace(rank)
    with trace.span("forward", micro_batch=rank):
        time.sleep(0.01)
    gathered = trace.gather()
    return None if gathered is None else [t.events[0].micro_batch for t in gathered]


def test_trace_spans_and_gather():
    assert run_on_ranks(_span_and_gather, 3) == [[0, 1, 2], None, None]
