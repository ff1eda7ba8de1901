"""Objects between workers and parameter servers travel without pickle
(:mod:`lightning_par.paramserver.wire`): what the servers need round-trips exactly, and a
pickled payload is refused before any of it runs."""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable

import pytest
import torch
from torch import nn

from lightning_par.comm import Communicator, RankFailed, run_on_ranks
from lightning_par.paramserver import protocol, wire
from lightning_par.paramserver.clipping import GradClip
from lightning_par.paramserver.messages import recv_object, send_object
from lightning_par.paramserver.plan import ShardPlan
from lightning_par.paramserver.protocol import Header, Kind
from lightning_par.paramserver.spec import server_spec


def _optimizer() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    opt = torch.optim.Adam(
        [{"params": model[0].parameters()}, {"params": model[1].parameters(), "lr": 0.5}],
        betas=(0.8, 0.95),
    )
    model(torch.randn(5, 3)).sum().backward()
    opt.step()
    return model, opt


def test_an_optimizer_state_round_trips_bit_for_bit() -> None:
    _, opt = _optimizer()
    state = opt.state_dict()
    back = wire.decode(wire.encode(state))
    assert back["param_groups"] == state["param_groups"]  # betas stay a tuple, keys ints
    assert back["state"].keys() == state["state"].keys()
    for key, values in state["state"].items():
        for name, tensor in values.items():
            assert back["state"][key][name].dtype == tensor.dtype
            assert torch.equal(back["state"][key][name], tensor), name


def test_a_server_spec_round_trips_with_the_optimizer_as_a_name() -> None:
    model, opt = _optimizer()
    params = list(model.parameters())
    plan = ShardPlan(2, (12, 4, 8, 2), (4, 4, 4, 4), ())
    spec = server_spec(opt, params, 3, [[3, 2], [1, 0]], plan, GradClip(1.5))
    data = wire.encode(spec)
    assert b"Adam" in data and b"torch.optim" not in data  # a name, not a pickled class
    assert wire.decode(data) == spec


def test_other_types_are_refused_on_both_sides() -> None:
    class Evil(torch.optim.SGD):
        pass

    with pytest.raises(wire.WireError, match="cannot send the class Evil"):
        wire.encode({"optimizer_cls": Evil})
    with pytest.raises(wire.WireError, match="cannot send a function"):
        wire.encode(lambda: 0)
    doc = b'{"~o": "LBFGS"}'
    with pytest.raises(wire.WireError, match="refused the optimiser 'LBFGS'"):
        wire.decode(wire.MAGIC + len(doc).to_bytes(8, "little") + doc)
    doc = b'{"~c": ["Popen", {}]}'
    with pytest.raises(wire.WireError, match="refused an object of type 'Popen'"):
        wire.decode(wire.MAGIC + len(doc).to_bytes(8, "little") + doc)


class _Payload:
    """Unpickling this would create the file ``path``."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_pickled_payload_is_refused_and_never_runs(tmp_path) -> None:
    marker = tmp_path / "ran"
    data = pickle.dumps({"spec": _Payload(str(marker))})
    with pytest.raises(wire.WireError, match="accept no pickled objects"):
        wire.decode(data)
    assert not marker.exists()


def _pickle_to_a_server(rank: int, world_size: int, marker: str) -> str | None:
    """Rank 0 plays worker 0 and sends a pickled "spec" framed as an object message; rank 1
    is a parameter server, which must refuse it."""
    comm = Communicator()
    if rank == 0:
        data = torch.frombuffer(bytearray(pickle.dumps(_Payload(marker))), dtype=torch.uint8)
        comm.send(torch.tensor([data.numel()], dtype=torch.int64), 1, tag=Kind.OBJECT)
        comm.send(data, 1, tag=Kind.OBJECT)
        send_object(comm, {"ok": torch.arange(3)}, 1)  # the wire format is taken
        return None
    try:
        recv_object(comm, 0)
    except wire.WireError as err:
        return f"{str(err)} | then {recv_object(comm, 0)}"
    return "read without error"


def test_a_pickled_payload_from_another_process_is_refused(tmp_path) -> None:
    marker = str(tmp_path / "ran")
    _, message = run_on_ranks(_pickle_to_a_server, 2, marker, timeout=30)
    assert "accept no pickled objects" in message, message
    assert "then {'ok': tensor([0, 1, 2])}" in message
    assert not os.path.exists(marker)


def _pickle_spec_to_serve(rank: int, world_size: int, marker: str) -> None:
    from lightning_par.paramserver import serve

    comm = Communicator()
    if rank == 1:
        serve(comm, 0)
        return
    data = torch.frombuffer(bytearray(pickle.dumps(_Payload(marker))), dtype=torch.uint8)
    comm.send(torch.tensor([data.numel()], dtype=torch.int64), 1, tag=Kind.OBJECT)
    comm.send(data, 1, tag=Kind.OBJECT)
    import time

    time.sleep(60)  # stopped when the server fails


def test_a_server_refuses_a_pickled_spec(tmp_path) -> None:
    marker = str(tmp_path / "ran")
    with pytest.raises(RankFailed) as err:
        run_on_ranks(_pickle_spec_to_serve, 2, marker, timeout=30)
    assert "WireError" in str(err.value) and "no pickled objects" in str(err.value)
    assert not os.path.exists(marker)


def _decoders() -> dict[str, Callable[[torch.Tensor], object]]:
    """Every decoder of the protocol module, called as a receiver would."""
    return {
        "Header.decode": lambda m: Header.decode(m, 2),
        "decode_slices": lambda m: protocol.decode_slices(m, [m.numel()]),
        "decode_push": lambda m: protocol.decode_push(m, m.numel() - 1, 1),
        "decode_info": protocol.decode_info,
        "decode_work": protocol.decode_work,
        "decode_norm": protocol.decode_norm,
        "decode_object_size": lambda m: protocol.decode_object_size(m, "rank 0"),
        "decode_object": protocol.decode_object,
        "decode_spec": protocol.decode_spec,
        "decode_state": protocol.decode_state,
        "decode_update": lambda m: protocol.decode_update(m, m.numel() - 1, 1),
        "decode_ack": protocol.decode_ack,
        "decode_count": lambda m: protocol.decode_count(m, Kind.RECOVER),
        "decode_missing": lambda m: protocol.decode_missing(m, 3),
    }


def test_the_list_below_holds_every_decoder_of_the_protocol() -> None:
    names = {n for n in dir(protocol) if n.startswith("decode")} | {"Header.decode"}
    assert names == set(_decoders())


@pytest.mark.parametrize("name", sorted(_decoders()))
def test_every_decoder_refuses_a_pickled_payload(name, tmp_path) -> None:
    marker = tmp_path / "ran"
    payload = torch.frombuffer(bytearray(pickle.dumps(_Payload(str(marker)))), dtype=torch.uint8)
    with pytest.raises((protocol.ProtocolError, wire.WireError), match="pickled objects"):
        _decoders()[name](payload)
    assert not marker.exists()
