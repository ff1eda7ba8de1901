"""The parameter-server protocol, all of it: commands, message kinds and the header
(:mod:`.header`), and the encoder and decoder of every other kind (:mod:`.payloads`);
:mod:`~lightning_par.paramserver.messages` moves them over a
:class:`~lightning_par.comm.Communicator`, and nothing else builds or reads a message.

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

With ``fault_tolerant`` every message of a shard travels on that shard's tag
(:class:`ShardTag`), every request gets an answer from every shard (``DONE`` where it
returns no data), and a primary sends its backup each update it applied (``UPDATE``,
answered by ``ACK``); a worker that lost a server agrees with its shard's new holder with
``RECOVER`` (:mod:`.recovery`); after a step's pushes each shard tells every live worker
which lost workers' pushes it lacks (``MISSING``), which worker 0 then sends in their place.

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

from lightning_par.paramserver.protocol.header import (
    IDLE_TIMEOUT,
    MAGIC,
    NONE,
    SHARD_STRIDE,
    Command,
    Header,
    Kind,
    ProtocolError,
    ShardTag,
    header_size,
    server_rank,
)
from lightning_par.paramserver.protocol.payloads import (
    INFO_SIZE,
    MAX_OBJECT_BYTES,
    Info,
    decode_info,
    decode_norm,
    decode_object,
    decode_object_size,
    decode_push,
    decode_slices,
    decode_spec,
    decode_state,
    decode_work,
    encode_info,
    encode_norm,
    encode_object,
    encode_push,
    encode_slices,
    encode_work,
    info_buffer,
    norm_buffer,
    object_size_buffer,
    push_buffer,
    push_size,
    work_buffer,
)
from lightning_par.paramserver.protocol.recovery import (
    ack_buffer,
    count_buffer,
    decode_ack,
    decode_count,
    decode_missing,
    decode_update,
    encode_ack,
    encode_count,
    encode_missing,
    encode_update,
    missing_buffer,
)

__all__ = [
    "IDLE_TIMEOUT",
    "INFO_SIZE",
    "MAGIC",
    "MAX_OBJECT_BYTES",
    "NONE",
    "SHARD_STRIDE",
    "Command",
    "Header",
    "Info",
    "Kind",
    "ProtocolError",
    "ShardTag",
    "ack_buffer",
    "count_buffer",
    "decode_ack",
    "decode_count",
    "decode_missing",
    "decode_update",
    "encode_ack",
    "encode_count",
    "encode_missing",
    "encode_update",
    "missing_buffer",
    "decode_info",
    "decode_norm",
    "decode_object",
    "decode_object_size",
    "decode_push",
    "decode_slices",
    "decode_spec",
    "decode_state",
    "decode_work",
    "encode_info",
    "encode_norm",
    "encode_object",
    "encode_push",
    "encode_slices",
    "encode_work",
    "header_size",
    "info_buffer",
    "norm_buffer",
    "object_size_buffer",
    "push_buffer",
    "push_size",
    "server_rank",
    "work_buffer",
]
