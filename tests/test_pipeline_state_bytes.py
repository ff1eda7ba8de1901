"""A stage's state reaches rank 0 as ``torch.save`` bytes (:mod:`lightning_par.pipeline.state`);
rank 0 reads them with ``weights_only=True``, so a peer's pickled object is refused and
never runs (the other decoder of bytes from another process, beside the parameter
servers' :mod:`~lightning_par.paramserver.wire`, tested in ``test_paramserver_wire.py``)."""

from __future__ import annotations

import io
import os

import torch

from lightning_par.comm import Communicator, run_on_ranks
from lightning_par.pipeline.state import gather_objects


class _Payload:
    """Unpickling this creates the file at ``path``: proof that code ran."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _send_pickled_state(rank: int, world_size: int, marker: str) -> str | None:
    """Rank 1 frames a pickled object as its stage state, as ``gather_objects`` sends one;
    rank 0 gathers and must refuse it."""
    comm = Communicator()
    if rank == 1:
        buffer = io.BytesIO()
        torch.save({"weight": torch.ones(2), "evil": _Payload(marker)}, buffer)
        data = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
        comm.send(torch.tensor([data.numel()], dtype=torch.int64), 0, tag="size")
        comm.send(data, 0, tag="state")
        return None
    try:
        gather_objects(comm, {"weight": torch.zeros(2)}, torch.device("cpu"))
    except Exception as err:  # noqa: BLE001 -- the message is what the test reads
        return f"{type(err).__name__}: {err}"
    return "read without error"


def test_a_pickled_stage_state_from_another_process_is_refused(tmp_path) -> None:
    marker = str(tmp_path / "ran")
    message, _ = run_on_ranks(_send_pickled_state, 2, marker, timeout=30)
    assert "Weights only load failed" in message, message
    assert not os.path.exists(marker)


def _send_plain_state(rank: int, world_size: int) -> list | None:
    comm = Communicator()
    return gather_objects(comm, {"w": torch.full((2,), float(rank))}, torch.device("cpu"))


def test_a_plain_stage_state_is_gathered() -> None:
    gathered, _ = run_on_ranks(_send_plain_state, 2, timeout=30)
    assert [s["w"].tolist() for s in gathered] == [[0.0, 0.0], [1.0, 1.0]]
