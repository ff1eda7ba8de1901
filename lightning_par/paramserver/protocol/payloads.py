"""The encoder and decoder of every message kind but the header (:mod:`.header`): each
decoder checks the dtype and size its kind has before reading anything (the protocol as a
whole: :mod:`lightning_par.paramserver.protocol`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lightning_par.paramserver import wire
from lightning_par.paramserver.protocol.header import Kind, ProtocolError
from lightning_par.paramserver.spec import ServerSpec


def expect(message: torch.Tensor, kind: Kind, dtypes: tuple[torch.dtype, ...], numel: int) -> None:
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
    expect(message, kind, _FLOATS, sum(sizes))
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


def decode_push(message: torch.Tensor, num_elements: int, num_slices: int,
                kind: Kind = Kind.PUSH) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The gradient and the "has a gradient" mask of a received (or summed) ``PUSH`` (or of
    an ``UPDATE``, which has a push's layout)."""
    expect(message, kind, _FLOATS, push_size(num_elements, num_slices))
    return message[:num_elements], message[num_elements:] > 0


# ---- INFO: what an asynchronous server says about the update it applied ----------------------
#: Numbers in an ``INFO`` message: staleness of the update just applied, the worker's lead
#: over the slowest worker when answered, the server's version.
INFO_SIZE = 3


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
    expect(message, Kind.INFO, (torch.float64,), INFO_SIZE)
    staleness, lead, version = (int(v) for v in message.tolist())
    return Info(staleness, lead, version)


# ---- WORK: the shared batch server 0 hands a worker -----------------------------------------
def encode_work(epoch: int, batch: int) -> torch.Tensor:
    """A ``WORK`` reply: the ``(epoch, batch)`` to load next (batch :data:`NONE`: none)."""
    return torch.tensor([epoch, batch], dtype=torch.int64)


def work_buffer() -> torch.Tensor:
    return torch.zeros(2, dtype=torch.int64)


def decode_work(message: torch.Tensor) -> tuple[int, int]:
    expect(message, Kind.WORK, (torch.int64,), 2)
    epoch, batch = message.tolist()
    return int(epoch), int(batch)


# ---- NORM: one server's squared gradient norm (clipping by norm) ----------------------------
def encode_norm(squared: float) -> torch.Tensor:
    return torch.tensor([squared], dtype=torch.float64)


def norm_buffer() -> torch.Tensor:
    return torch.zeros(1, dtype=torch.float64)


def decode_norm(message: torch.Tensor) -> float:
    expect(message, Kind.NORM, (torch.float64,), 1)
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
    expect(message, Kind.OBJECT, (torch.int64,), 1)
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
