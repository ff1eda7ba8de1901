"""The parameter-server protocol, all of it: commands, message kinds, the header layout.

Ranks: workers are ``0 .. W-1`` and servers ``W .. W+S-1`` of one process group
(:func:`server_rank`). Like ps-lite's one message type with a command field and gloo's one
header struct, every exchange starts with one **header** from a worker to a server (kind
:attr:`Kind.HEADER`), a float64 tensor (float64 so every hyperparameter arrives exactly)::

    [MAGIC, command, step, n, hyper_1 .. hyper_n, trained_epoch, trained_batch, count]

* ``command``: a :class:`Command`;
* ``step``: the worker's step (``NEXT``: the epoch it asks a batch of);
* ``hyper``: every number of every optimiser param group (``lr``, ``momentum``, ``betas``,
  ...), so what a scheduler changes on the workers reaches the servers
  (:func:`~lightning_par.paramserver.spec.hyper_values`);
* ``trained_epoch, trained_batch``: the shared batch the worker trained last
  (asynchronous SGD with shared work acknowledges it with its push; :data:`NONE` else);
* ``count``: ``NEXT``: the number of batches in the epoch (:data:`NONE` else).

The synchronous and the asynchronous server read the same header; :meth:`Header.decode`
checks the magic number, the command and the length, so a message of another kind or of
another layout is a :class:`ProtocolError`, never silently mis-read.

Every kind of message travels on its own gloo tag (:class:`Kind`, passed through
:class:`~lightning_par.comm.Communicator`), so a receive matches the next message *of its
kind* from that peer, whatever else was posted in between (a request for work from the
main thread, a push from the communication thread); a gloo send completes once the peer
has posted the receive of its kind, not before. What follows a header, by command:

* ``STEP``: per gradient bucket one ``PUSH`` (gradient slices, then one "has a gradient"
  flag per slice) from the worker and one ``PULL`` (the updated slices) back; the
  asynchronous server adds one ``INFO`` (:data:`INFO_SIZE` floats: staleness, lead over
  the slowest worker, server version) after the last bucket; with clipping by norm the
  synchronous server waits for every bucket, then sends every other server its shard's
  squared gradient norm (``NORM``, one float64) before it applies any
  (:mod:`~lightning_par.paramserver.clipping`);
* ``PULL`` (asynchronous): the server's current slices, one ``PULL`` per bucket;
* ``NEXT`` (asynchronous, server 0): one ``WORK`` reply, int64 ``[epoch, batch]``;
* ``GET_STATE``: each server sends worker 0 its optimiser state slices (``OBJECT``);
* ``SET_STATE``: worker 0 sends each server the full optimiser state (``OBJECT``);
* ``STOP``: the server ends (asynchronous: once every worker stopped, each gets the final
  slices, one ``PULL`` per bucket).

Before the first header, worker 0 sends each server its
:class:`~lightning_par.paramserver.spec.ServerSpec` (``OBJECT``, ``None`` when nothing is
trained), then its initial weight slices (``INIT``), which the server sends to every
worker (``INIT``). An ``OBJECT`` is two messages: its length (int64), then its bytes in
:mod:`~lightning_par.paramserver.wire` (tensors plus a JSON description, never pickle).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from enum import IntEnum

import torch


class ProtocolError(RuntimeError):
    """A message that is not what the protocol says comes next."""


class Command(IntEnum):
    """What a header asks of a server."""

    STOP = 0
    STEP = 1
    GET_STATE = 2
    SET_STATE = 3
    PULL = 4
    NEXT = 5


class Kind(IntEnum):
    """A kind of message, and the gloo tag it travels on (0 is left to everything else)."""

    HEADER = 1
    OBJECT = 2
    INIT = 3
    PUSH = 4
    PULL = 5
    INFO = 6
    WORK = 7
    NORM = 8


#: "No batch" in a header's trained/count fields and in a ``WORK`` reply.
NONE = -1
#: The first number of every header ("PS").
MAGIC = 20563.0
#: Numbers in an ``INFO`` message: staleness of the update just applied, the worker's lead
#: over the slowest worker when answered, the server's version.
INFO_SIZE = 3
#: How long a server waits for the next header (validation, checkpointing, a slow data
#: loader happen between steps); messages within a step keep the group's timeout.
IDLE_TIMEOUT = timedelta(days=7)

_FIXED = 4  # MAGIC, command, step, n
_TAIL = 3  # trained_epoch, trained_batch, count


def server_rank(num_workers: int, server: int) -> int:
    """The group rank of server ``server``."""
    return num_workers + server


def header_size(num_hyper: int) -> int:
    """Numbers in a header carrying ``num_hyper`` hyperparameters."""
    return _FIXED + num_hyper + _TAIL


@dataclass(frozen=True)
class Header:
    """One header (see the module docstring for each field)."""

    command: Command
    step: int = 0
    hyper: tuple[float, ...] = ()
    trained: tuple[int, int] = (NONE, NONE)
    count: int = NONE

    def encode(self) -> torch.Tensor:
        """The float64 tensor that travels (every int here is exact in a float64)."""
        head = [MAGIC, float(self.command), float(self.step), float(len(self.hyper))]
        values = [*head, *map(float, self.hyper), *map(float, self.trained), float(self.count)]
        return torch.tensor(values, dtype=torch.float64)

    @staticmethod
    def buffer(num_hyper: int) -> torch.Tensor:
        """An empty header to receive into."""
        return torch.zeros(header_size(num_hyper), dtype=torch.float64)

    @staticmethod
    def decode(message: torch.Tensor, num_hyper: int, sender: str = "a worker") -> Header:
        """Read a received header, checking that it is one, of the layout the server
        expects (``num_hyper`` hyperparameters, as the spec said)."""
        values = message.tolist()
        if message.dtype != torch.float64 or not values or values[0] != MAGIC:
            raise ProtocolError(
                f"the message from {sender} is not a parameter-server header (it starts "
                f"{values[:4]} in {message.dtype}, a header starts [{MAGIC}, ...] in float64): "
                "a message of another kind was taken for a header"
            )
        if len(values) != header_size(num_hyper) or values[3] != num_hyper:
            carried = int(values[3]) if len(values) > 3 else "?"
            raise ProtocolError(
                f"the header from {sender} has {len(values)} numbers carrying {carried} "
                f"hyperparameters; this server expects "
                f"{header_size(num_hyper)} carrying {num_hyper}: its sender uses another header "
                "layout, or its optimiser's param groups differ from worker 0's"
            )
        try:
            command = Command(int(values[1]))
        except ValueError:
            raise ProtocolError(
                f"the header from {sender} has an unknown command {values[1]} "
                f"(known: {', '.join(f'{c.name}={c.value}' for c in Command)})"
            ) from None
        tail = values[_FIXED + num_hyper :]
        return Header(command, int(values[2]), tuple(values[_FIXED : _FIXED + num_hyper]),
                      (int(tail[0]), int(tail[1])), int(tail[2]))  # fmt: skip


def push_size(num_elements: int, num_slices: int) -> int:
    """Numbers in a ``PUSH`` of ``num_slices`` slices holding ``num_elements`` in all."""
    return num_elements + num_slices


def push_message(grads: Sequence[torch.Tensor], flags: Sequence[torch.Tensor]) -> torch.Tensor:
    """A ``PUSH``: the gradient slices (flat), then one flag per slice (1: it has a
    gradient; 0: the parameter was unused this step and must be skipped, as in one
    process)."""
    return torch.cat([*(g.flatten() for g in grads), torch.stack(list(flags)).to(grads[0].dtype)])


def split_push(message: torch.Tensor, num_elements: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradient and the "has a gradient" mask of a received (or summed) ``PUSH``."""
    return message[:num_elements], message[num_elements:] > 0


def info_message(staleness: int, lead: int, version: int) -> torch.Tensor:
    return torch.tensor([float(staleness), float(lead), float(version)])


def info_buffer() -> torch.Tensor:
    return torch.zeros(INFO_SIZE)


def work_message(epoch: int, batch: int) -> torch.Tensor:
    """A ``WORK`` reply: the ``(epoch, batch)`` to load next (batch :data:`NONE`: none)."""
    return torch.tensor([epoch, batch], dtype=torch.int64)


def work_buffer() -> torch.Tensor:
    return torch.zeros(2, dtype=torch.int64)
