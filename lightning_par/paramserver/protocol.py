"""The parameter-server protocol, all of it: commands, message kinds, and the encoder and
decoder of every kind (:mod:`~lightning_par.paramserver.messages` moves them over a
:class:`~lightning_par.comm.Communicator`; nothing else builds or reads a message).

Ranks: workers are ``0 .. W-1`` and servers ``W .. W+S-1`` of one process group
(:func:`server_rank`). Like ps-lite's one message type with a command field and gloo's one
header struct, every exchange starts with one **header** from a worker to a server, a
float64 tensor (float64 so every hyperparameter arrives exactly)::

    [MAGIC, command, step, n, hyper_1 .. hyper_n, trained_epoch, trained_batch, count]

``step`` is the worker's step (``NEXT``: the epoch it asks a batch of); ``hyper`` every
number of every optimiser param group, so what a scheduler changes on the workers reaches
the servers (:func:`~lightning_par.paramserver.spec.hyper_values`); ``trained`` the shared
batch the worker trained last (asynchronous SGD with shared work; :data:`NONE` else);
``count`` (``NEXT``) the number of batches in the epoch.

Every kind travels on its own gloo tag (:class:`Kind`), so a receive matches the next
message *of its kind* from that peer, whatever else was posted in between. By command:

* ``STEP``: per gradient bucket one ``PUSH`` (:func:`encode_push`) and one ``PULL`` back
  (:func:`encode_slices`); the asynchronous server adds one ``INFO`` (:class:`Info`) after
  the last bucket; with clipping by norm every synchronous server sends every other one its
  shard's squared gradient norm (``NORM``) before it applies any;
* ``PULL`` (asynchronous): the server's current slices, one ``PULL`` per bucket;
* ``NEXT`` (asynchronous, server 0): one ``WORK`` reply, int64 ``[epoch, batch]``;
* ``GET_STATE`` / ``SET_STATE``: optimiser state slices to worker 0 / the full state from
  worker 0 (``OBJECT``, :func:`decode_state`);
* ``STOP``: the server ends (asynchronous: once every worker stopped, each gets the final
  slices, one ``PULL`` per bucket).

Before the first header, worker 0 sends each server its
:class:`~lightning_par.paramserver.spec.ServerSpec` (``OBJECT``, :func:`decode_spec`;
``None`` means stop: nothing is trained), then its initial weight slices (``INIT``), which
the server sends to every worker. An ``OBJECT`` is its length (int64), then its bytes in
:mod:`~lightning_par.paramserver.wire` (tensors plus a JSON description, never pickle).

Every decoder first checks the dtype and size the protocol gives its kind, so a message of
another kind or layout, or a pickle's bytes, is a :class:`ProtocolError` (an object's bytes:
a :class:`~lightning_par.paramserver.wire.WireError`), never silently mis-read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from enum import IntEnum
from typing import Any

import torch

from lightning_par.paramserver import wire
from lightning_par.paramserver.spec import ServerSpec


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


def _expect(message: torch.Tensor, kind: Kind, dtypes: tuple[torch.dtype, ...], numel: int) -> None:
    """Refuse a received ``kind`` message of another dtype or size (a pickle's bytes, a
    message of another kind): the decoders below read nothing before this passes."""
    if message.dtype not in dtypes or message.numel() != numel:
        raise ProtocolError(
            f"a {kind.name} message of {message.numel()} {message.dtype} values; the protocol "
            f"says {numel} in {' or '.join(map(str, dtypes))}: a message of another kind or "
            "layout (parameter servers accept no pickled objects)"
        )


_FLOATS = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


# ---- INIT and PULL: a bucket's slices, flat, in the client plan's order ----------------------
def encode_slices(slices: Sequence[torch.Tensor]) -> torch.Tensor:
    """An ``INIT`` or ``PULL``: one bucket's slices on one server, flat, in plan order (one
    flat tensor is its own message: a server's slices live in one)."""
    if len(slices) == 1:
        return slices[0].detach().reshape(-1)
    return torch.cat([s.detach().flatten() for s in slices])


def decode_slices(message: torch.Tensor, sizes: Sequence[int], kind: Kind = Kind.PULL
                  ) -> list[torch.Tensor]:  # fmt: skip
    """The slices (views, of ``sizes`` elements each) of a received ``INIT``/``PULL``."""
    _expect(message, kind, _FLOATS, sum(sizes))
    return list(message.split(list(sizes)))


# ---- PUSH: gradient slices, then one "has a gradient" flag per slice ------------------------
def push_size(num_elements: int, num_slices: int) -> int:
    """Numbers in a ``PUSH`` of ``num_slices`` slices holding ``num_elements`` in all."""
    return num_elements + num_slices


def encode_push(grads: Sequence[torch.Tensor], flags: Sequence[torch.Tensor]) -> torch.Tensor:
    """A ``PUSH``: the gradient slices (flat), then one flag per slice (1: it has a
    gradient; 0: the parameter was unused this step and must be skipped, as in one
    process)."""
    return torch.cat([*(g.flatten() for g in grads), torch.stack(list(flags)).to(grads[0].dtype)])


def push_buffer(num_elements: int, num_slices: int, dtype: torch.dtype) -> torch.Tensor:
    """An empty ``PUSH`` to receive into."""
    return torch.empty(push_size(num_elements, num_slices), dtype=dtype)


def decode_push(message: torch.Tensor, num_elements: int, num_slices: int
                ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The gradient and the "has a gradient" mask of a received (or summed) ``PUSH``."""
    _expect(message, Kind.PUSH, _FLOATS, push_size(num_elements, num_slices))
    return message[:num_elements], message[num_elements:] > 0


# ---- INFO: what an asynchronous server says about the update it applied ----------------------
@dataclass(frozen=True)
class Info:
    """Staleness of the update just applied, the worker's lead over the slowest worker when
    answered, the server's version."""

    staleness: int
    lead: int
    version: int


def encode_info(info: Info) -> torch.Tensor:
    values = [float(info.staleness), float(info.lead), float(info.version)]
    return torch.tensor(values, dtype=torch.float64)


def info_buffer() -> torch.Tensor:
    return torch.zeros(INFO_SIZE, dtype=torch.float64)


def decode_info(message: torch.Tensor) -> Info:
    _expect(message, Kind.INFO, (torch.float64,), INFO_SIZE)
    staleness, lead, version = (int(v) for v in message.tolist())
    return Info(staleness, lead, version)


# ---- WORK: the shared batch server 0 hands a worker -----------------------------------------
def encode_work(epoch: int, batch: int) -> torch.Tensor:
    """A ``WORK`` reply: the ``(epoch, batch)`` to load next (batch :data:`NONE`: none)."""
    return torch.tensor([epoch, batch], dtype=torch.int64)


def work_buffer() -> torch.Tensor:
    return torch.zeros(2, dtype=torch.int64)


def decode_work(message: torch.Tensor) -> tuple[int, int]:
    _expect(message, Kind.WORK, (torch.int64,), 2)
    epoch, batch = message.tolist()
    return int(epoch), int(batch)


# ---- NORM: one server's squared gradient norm (clipping by norm) ----------------------------
def encode_norm(squared: float) -> torch.Tensor:
    return torch.tensor([squared], dtype=torch.float64)


def norm_buffer() -> torch.Tensor:
    return torch.zeros(1, dtype=torch.float64)


def decode_norm(message: torch.Tensor) -> float:
    _expect(message, Kind.NORM, (torch.float64,), 1)
    return float(message)


# ---- OBJECT: the spec (STOP before a spec: ``None``) and optimiser state ---------------------
#: The largest object a rank accepts (an optimiser state of a few GiB models fits).
MAX_OBJECT_BYTES = 1 << 36


def encode_object(obj: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """An ``OBJECT`` as its two messages: the length (int64), then the bytes
    (:func:`lightning_par.paramserver.wire.encode`: JSON and tensor data, no pickle)."""
    data = torch.frombuffer(bytearray(wire.encode(obj)), dtype=torch.uint8)
    return torch.tensor([data.numel()], dtype=torch.int64), data


def object_size_buffer() -> torch.Tensor:
    return torch.zeros(1, dtype=torch.int64)


def decode_object_size(message: torch.Tensor, sender: str) -> int:
    """The length an ``OBJECT`` announces (refused past :data:`MAX_OBJECT_BYTES`)."""
    _expect(message, Kind.OBJECT, (torch.int64,), 1)
    if not 0 <= int(message) <= MAX_OBJECT_BYTES:
        raise wire.WireError(f"refused an object of {int(message)} bytes from {sender}")
    return int(message)


def decode_object(data: torch.Tensor) -> Any:
    """The object in an ``OBJECT``'s bytes; any other format (a pickle) is a
    :class:`~lightning_par.paramserver.wire.WireError`."""
    if data.dtype != torch.uint8:
        raise wire.WireError(f"an object message of {data.dtype} values, not bytes")
    return wire.decode(data.numpy().tobytes())


def decode_spec(data: torch.Tensor) -> ServerSpec | None:
    """Worker 0's first object: the server's spec, or ``None`` (stop: nothing is trained)."""
    spec = decode_object(data)
    if spec is not None and not isinstance(spec, ServerSpec):
        raise ProtocolError(f"expected a ServerSpec (or None) first, got a {type(spec).__name__}")
    return spec


def decode_state(data: torch.Tensor) -> dict[Any, Any]:
    """An optimiser state (``SET_STATE``: a ``state_dict``; ``GET_STATE``: slices by key)."""
    state = decode_object(data)
    if not isinstance(state, dict):
        raise ProtocolError(f"expected an optimiser state (a dict), got a {type(state).__name__}")
    return state
