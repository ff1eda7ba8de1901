"""Commands, message kinds and the header every exchange starts with (the protocol as a
whole: :mod:`lightning_par.paramserver.protocol`)."""

from __future__ import annotations

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
    UPDATE = 9  # (fault_tolerant) the update a primary applied, to its shard's backup
    ACK = 10  # (fault_tolerant) the backup holds what the primary sent it
    RECOVER = 11  # (fault_tolerant) worker and new holder of a lost server's shard agree
    DONE = 12  # (fault_tolerant) a holder's answer to a request that returns no data
    MISSING = 13  # (fault_tolerant) after a step's pushes: the lost workers a shard lacks


#: Tags per shard (``fault_tolerant``): one process may hold two shards (its own and a
#: lost server's), each answered by its own thread, so each shard's messages of one kind
#: travel on a tag of their own.
SHARD_STRIDE = 16


class ShardTag(int):
    """The gloo tag of ``kind`` for shard ``shard`` (above every plain :class:`Kind`); a
    trace labels it as the kind (``push``, ``pull``) whichever shard it is for."""

    label: str

    def __new__(cls, kind: Kind, shard: int) -> ShardTag:
        tag = super().__new__(cls, int(kind) + SHARD_STRIDE * (shard + 1))
        tag.label = kind.name.lower()
        return tag


#: "No batch" in a header's trained/count fields and in a ``WORK`` reply.
NONE = -1
#: The first number of every header ("PS").
MAGIC = 20563.0
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
    """One header (each field: :mod:`lightning_par.paramserver.protocol`)."""

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
                "a message of another kind was taken for a header (parameter servers accept no "
                "pickled objects)"
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
