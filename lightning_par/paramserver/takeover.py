"""Taking over a lost server's shard: its copy answers the workers from where it got, and
the request the loss interrupted is answered exactly once.

A worker notices the loss at an answer it waits for from the lost server: gloo fails every
message of a closed connection at once, and a frozen server is first killed by the worker
that started it, once the heartbeat finds it silent for ``dead_peer_timeout``
(:mod:`lightning_par.paramserver.process`). The worker then asks the next server on the
ring, which kept the copy, with ``RECOVER n``: the request it waits for an answer to. A
primary answers nothing before its backup holds the record (:mod:`.replication`) and a
worker sends a request only once it has every answer to the one before, so ``n`` is the
copy's last whole record ``done`` or the next one:

* ``n == done``: the copy holds the request, so the new holder sends this worker its
  answer as the shard stands (nothing later was applied: this worker has not sent it);
* ``n == done + 1``: the worker sends its request again (it kept it) and the new holder
  answers it as any request, without applying again the buckets the copy applied already.

Either way every update is applied once and is the lost primary's, bit for bit. Workers
come at different times (one can be a request ahead, held in a collective of the workers
until the other catches up), so each is answered on a thread of its own while the shard's
requests are already served.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from lightning_par.comm import CommError, Communicator
from lightning_par.paramserver import protocol
from lightning_par.paramserver.lost_workers import LostWorkers
from lightning_par.paramserver.protocol import IDLE_TIMEOUT, Command, Kind, ProtocolError
from lightning_par.paramserver.replication import Progress
from lightning_par.paramserver.server import ShardOptimizer

Answer = Callable[[int, int, Command | None], None]


def resume_workers(
    comm: Communicator, shard: ShardOptimizer, progress: Progress, answer_again: Answer,
    announce: Callable[[], None], lost: LostWorkers,
) -> None:  # fmt: skip
    """The new holder of ``shard``: agree with every worker where it resumes
    (``answer_again(worker, n, command)`` sends the answer to request ``n`` again), then
    ``announce`` the takeover. A worker lost too (in the same step, say) is
    let go into ``lost``: the holder's requests then go on without it, as any shard's do
    (:mod:`.lost_workers`)."""
    errors: list[BaseException] = []

    def one(worker: int) -> None:
        try:
            _resume(comm, shard, progress, answer_again, worker)
        except CommError as err:
            if progress.last == Command.STOP:
                return  # the lost primary answered its stop: that worker has ended
            try:
                lost.lose(worker, err)  # (the last live one: raised again, the job ends)
            except BaseException as again:
                errors.append(again)
        except BaseException as err:
            errors.append(err)

    threads = [
        threading.Thread(target=one, args=(w,), daemon=True, name=f"ps-resume-worker-{w}")
        for w in range(shard.spec.num_workers)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    announce()


def _resume(
    comm: Communicator, shard: ShardOptimizer, progress: Progress, answer_again: Answer,
    worker: int,
) -> None:  # fmt: skip
    tag, buffer = shard.tag(Kind.RECOVER), protocol.count_buffer()
    comm.irecv(buffer, worker, tag=tag).wait(IDLE_TIMEOUT)
    n = protocol.decode_count(buffer, Kind.RECOVER)
    comm.send(protocol.encode_count(progress.done), worker, tag=tag)
    if n == progress.done:
        answer_again(worker, n, progress.last)
    elif n != progress.done + 1:
        raise ProtocolError(
            f"worker {worker} waits for the answer to request {n} of shard {shard.server}, "
            f"whose copy holds every request up to {progress.done}: a request was answered "
            "before its copy held it"
        )


def ask_to_resume(comm: Communicator, holder: int, shard: int, n: int) -> int:
    """A worker waiting for the answer to request ``n`` of lost ``shard``: ask its new
    ``holder`` (a group rank) where its copy stands; returns the copy's last whole request
    (``n``: the answer comes again; ``n - 1``: send request ``n`` again)."""
    tag, buffer = protocol.ShardTag(Kind.RECOVER, shard), protocol.count_buffer()
    comm.send(protocol.encode_count(n), holder, tag=tag)
    comm.recv(buffer, holder, tag=tag)
    done = protocol.decode_count(buffer, Kind.RECOVER)
    if n not in (done, done + 1):
        raise ProtocolError(
            f"shard {shard}'s new holder (rank {holder}) holds every request up to {done}; "
            f"this worker waits for the answer to {n}"
        )
    return done
