"""Moving model state between stages through the communicator: the initial weights from
rank 0 to every stage, and every stage's state dict to rank 0 for a full checkpoint."""

from __future__ import annotations

import io
from typing import Any

import torch

from lightning_par.comm import Communicator


def send_weights_from_first(
    comm: Communicator, stage_states: list[dict[str, torch.Tensor]] | None,
    local_state: dict[str, torch.Tensor], device: torch.device,
) -> None:  # fmt: skip
    """Copy rank 0's weights into every stage, so all stages start from one model even when
    each process built its own (``popen`` launch without a common seed).

    ``stage_states[s]``: on rank 0, stage ``s``'s tensors in its full network; ``local_state``:
    this rank's stage state dict (tensors sharing storage with its parameters and buffers)."""
    if comm.rank == 0:
        assert stage_states is not None
        handles = []
        for dst in range(1, comm.world_size):
            for name, tensor in stage_states[dst].items():
                payload = tensor.detach().to(device).contiguous()
                handles.append(comm.isend(payload, dst, tag=f"init:{name}"))
        for handle in handles:
            handle.wait()
        return
    for name, tensor in local_state.items():
        buf = torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
        comm.recv(buf, 0, tag=f"init:{name}")
        with torch.no_grad():
            tensor.copy_(buf)


def gather_objects(comm: Communicator, obj: Any, device: torch.device) -> list[Any] | None:
    """Every rank's ``obj`` (tensors inside are moved to CPU) as a list on rank 0, ``None``
    elsewhere; serialised with ``torch.save`` and sent as bytes."""
    if comm.rank != 0:
        buffer = io.BytesIO()
        torch.save(_to_cpu(obj), buffer)
        payload = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8).to(device)
        comm.send(torch.tensor([payload.numel()], dtype=torch.int64, device=device), 0, tag="size")
        comm.send(payload, 0, tag="state")
        return None
    out = [_to_cpu(obj)]
    for src in range(1, comm.world_size):
        size = torch.empty(1, dtype=torch.int64, device=device)
        comm.recv(size, src, tag="size")
        payload = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
        comm.recv(payload, src, tag="state")
        data = io.BytesIO(payload.cpu().numpy().tobytes())
        # tensors, numbers, strings and containers only: no code runs from a peer's bytes
        out.append(torch.load(data, map_location="cpu", weights_only=True))
    return out


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_cpu(v) for v in obj]
    return obj


def gather_full_state_dict(
    comm: Communicator | None, local: dict[str, Any], prefix: str, device: torch.device
) -> dict[str, Any]:
    """The full model's state dict on rank 0 (every stage's layers under their original
    names, which every stage keeps), ``local`` elsewhere or without a ``comm``
    (network not split). Entries starting with ``prefix`` (the network's attribute) are per
    stage; the others are equal on all ranks."""
    if comm is None:
        return local
    stages = gather_objects(comm, {k: v for k, v in local.items() if k.startswith(prefix)}, device)
    if stages is None:
        return local
    full = {k: v for k, v in local.items() if not k.startswith(prefix)}
    for stage_state in stages:
        full.update(stage_state)
    return full


def stage_optimizer_state(state: dict, rank: int) -> dict:
    """This stage's part of a state saved as ``{"pipeline_stages": [...]}`` by earlier
    versions (any other state is returned unchanged); checkpoints now hold the whole
    model's state in one process's format (:mod:`lightning_par.pipeline.optim_state`)."""
    return state["pipeline_stages"][rank] if "pipeline_stages" in state else state
