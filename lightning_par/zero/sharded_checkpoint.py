"""Checkpoints that stay sharded: every rank writes its own shards, nothing is gathered.

For a model whose whole weights and optimizer state do not fit one rank, as FSDP's sharded
state dict (which Lightning's ``FSDPStrategy(state_dict_type="sharded")`` also writes with
torch's distributed checkpoint, DCP). The checkpoint is a folder: DCP's files, holding each
rank's shard of every unit and of every optimizer state tensor under keys of its own
(``units.<i>.rank<r>``), the state's per-parameter flags and scalars, the buffers, and
``zero_meta.pt`` (rank 0's): the rest of Lightning's checkpoint and the layout (which
parameter lies where in which unit), from which :func:`consolidate` rebuilds one process's
checkpoint, in one process, for any other strategy (``python -m lightning_par.zero
consolidate FOLDER OUT.ckpt``). A sharded checkpoint resumes ``zero`` on as many ranks as
wrote it, with the same stage and units.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from lightning_par.comm import Communicator
from lightning_par.zero.optimizer import ShardedOptimizer
from lightning_par.zero.units import FlatUnit

META = "zero_meta.pt"
CONSOLIDATE = "python -m lightning_par.zero consolidate {path} whole.ckpt"


def is_sharded_checkpoint(path: Any) -> bool:
    """Whether ``path`` is a folder :func:`save_sharded` wrote."""
    return path is not None and (Path(str(path)) / META).is_file()


def _layout(units: list[FlatUnit], module: nn.Module) -> list[dict[str, Any]]:
    names = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    return [
        {"names": [names[id(p)] for p in u.params], "shapes": [tuple(p.shape) for p in u.params],
         "shard_numel": u.shard_numel, "dtype": str(u.dtype)}
        for u in units
    ]  # fmt: skip


def _optimizer_meta(sharded: ShardedOptimizer, module: nn.Module) -> dict[str, Any]:
    names = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    numbered = [p for ps in sharded.original for p in ps]
    groups = []
    n = 0
    for group, params in zip(sharded.optimizer.param_groups, sharded.original):
        groups.append({**{k: v for k, v in group.items() if k != "params"},
                       "params": list(range(n, n + len(params)))})  # fmt: skip
        n += len(params)
    return {"param_groups": groups, "numbering": [names[id(p)] for p in numbered],
            "kinds": sharded.state_kinds()}  # fmt: skip


def save_sharded(
    path: str | Path,
    checkpoint: dict[str, Any],
    units: list[FlatUnit],
    sharded: list[ShardedOptimizer],
    module: nn.Module,
    comm: Communicator,
) -> None:
    """Every rank: write this rank's shards of ``units`` and of the optimizers' states into
    the folder ``path``, and (rank 0) the rest of ``checkpoint`` beside them."""
    rank = comm.rank
    state: dict[str, torch.Tensor] = {f"units.{u.index}.rank{rank}": u.shard for u in units}
    buffers = {n for n, _ in module.named_buffers()}
    for name, value in checkpoint.get("state_dict", {}).items():
        if name in buffers:
            state[f"buffers.{name}"] = value
    for j, opt in enumerate(sharded):
        kinds = opt.state_kinds()
        for unit in units:
            for key, shaped in kinds.items():
                shard, has, scalars = opt.agreed_flags(unit, key, shaped, comm)
                prefix = f"optim.{j}.units.{unit.index}.{key}"
                state[f"{prefix}.flags"] = torch.stack([has, scalars])
                if shaped:
                    state[f"{prefix}.rank{rank}"] = shard
    Path(path).mkdir(parents=True, exist_ok=True)
    dcp.save(state, checkpoint_id=str(path), process_group=comm.group)
    if rank == 0:
        rest = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        meta = {"world_size": comm.world_size, "units": _layout(units, module),
                "order": list(checkpoint.get("state_dict", {})),
                "optimizers": [_optimizer_meta(o, module) for o in sharded]}  # fmt: skip
        torch.save({"checkpoint": rest, "zero": meta}, Path(path) / META)


def read_meta(path: str | Path) -> dict[str, Any]:
    """``zero_meta.pt``: the user's own checkpoint, so its training state is unpickled as
    Lightning unpickles a ``.ckpt``."""
    return torch.load(Path(path) / META, map_location="cpu", weights_only=False)


def check_resumable(
    meta: dict[str, Any], units: list[FlatUnit], module: nn.Module, world_size: int, path: Any
) -> None:
    """Refuse a sharded checkpoint these ranks cannot read their shards from."""
    saved = meta["zero"]
    if saved["world_size"] != world_size or saved["units"] != _layout(units, module):
        why = (f"it was written by {saved['world_size']} ranks, these are {world_size}"
               if saved["world_size"] != world_size else "its units are laid out otherwise "
               "(another stage, bucket_cap_mb or model)")  # fmt: skip
        raise ValueError(
            f"zero cannot resume from the sharded checkpoint {str(path)!r}: {why}. Make one "
            f"process's checkpoint of it first ({CONSOLIDATE.format(path=path)}) and resume "
            "from that, on any number of ranks"
        )


def load_sharded(
    path: str | Path,
    units: list[FlatUnit],
    sharded: list[ShardedOptimizer],
    module: nn.Module,
    comm: Communicator,
) -> dict[str, torch.Tensor]:
    """Every rank: read this rank's shards into ``units`` (stages 1-2 then all-gather the
    weights) and the optimizers' states; returns the buffers by name."""
    rank = comm.rank
    state: dict[str, torch.Tensor] = {f"units.{u.index}.rank{rank}": u.shard for u in units}
    buffers = {f"buffers.{n}": torch.empty_like(b) for n, b in module.named_buffers()}
    state.update(buffers)
    kinds = [opt.state_kinds() for opt in sharded]
    for j in range(len(sharded)):
        for unit in units:
            for key, shaped in kinds[j].items():
                prefix = f"optim.{j}.units.{unit.index}.{key}"
                state[f"{prefix}.flags"] = torch.zeros(2, len(unit.params), dtype=torch.float64,
                                                       device=unit.device)  # fmt: skip
                if shaped:
                    state[f"{prefix}.rank{rank}"] = torch.zeros_like(unit.shard)
    with torch.no_grad():
        dcp.load(state, checkpoint_id=str(path), process_group=comm.group)
    for j, opt in enumerate(sharded):
        opt.optimizer.state.clear()
        for unit in units:
            for key in kinds[j]:
                prefix = f"optim.{j}.units.{unit.index}.{key}"
                has, scalars = state[f"{prefix}.flags"].tolist()
                opt.load_key(unit, key, state.get(f"{prefix}.rank{rank}"), has, scalars)
    return {name[len("buffers.") :]: value for name, value in buffers.items()}


def consolidate(path: str | Path) -> dict[str, Any]:
    """One process's checkpoint (whole weights, whole optimizer state in its numbering) from
    the sharded folder ``path``, read in this process without any process group."""
    meta = read_meta(path)
    zero = meta["zero"]
    p = zero["world_size"]
    state: dict[str, torch.Tensor] = {}
    for i, unit in enumerate(zero["units"]):
        for r in range(p):
            state[f"units.{i}.rank{r}"] = torch.empty(unit["shard_numel"], dtype=_dtype(unit))
    reader = dcp.FileSystemReader(str(path))
    saved = reader.read_metadata().state_dict_metadata
    for key, item in saved.items():
        if key.startswith(("buffers.", "optim.")) and key not in state:
            state[key] = torch.empty(item.size, dtype=item.properties.dtype)
    dcp.load(state, checkpoint_id=str(path), no_dist=True)
    whole: dict[str, torch.Tensor] = {}
    flat_units = []
    for i, unit in enumerate(zero["units"]):
        flat = torch.cat([state[f"units.{i}.rank{r}"] for r in range(p)])
        flat_units.append(flat)
        for name, shape, start in _spans(unit):
            whole[name] = flat[start : start + _numel(shape)].view(shape).clone()
    whole.update({k[len("buffers.") :]: v for k, v in state.items() if k.startswith("buffers.")})
    checkpoint = dict(meta["checkpoint"])
    order = [k for k in zero.get("order", []) if k in whole]  # one process's order
    checkpoint["state_dict"] = {
        k: whole[k] for k in [*order, *(k for k in whole if k not in order)]
    }
    checkpoint["optimizer_states"] = [
        _whole_optimizer(j, opt, zero["units"], state, p)
        for j, opt in enumerate(zero["optimizers"])
    ]
    return checkpoint


def _whole_optimizer(j: int, opt: dict, units: list[dict], state: dict, p: int) -> dict:
    number = {name: n for n, name in enumerate(opt["numbering"])}
    whole: dict[int, dict[str, torch.Tensor]] = {}
    for i, unit in enumerate(units):
        for key, shaped in opt["kinds"].items():
            prefix = f"optim.{j}.units.{i}.{key}"
            has, scalars = state[f"{prefix}.flags"].tolist()
            flat = torch.cat([state[f"{prefix}.rank{r}"] for r in range(p)]) if shaped else None
            for k, (name, shape, start) in enumerate(_spans(unit)):
                if not has[k] or name not in number:
                    continue
                entry = whole.setdefault(number[name], {})
                if shaped:
                    entry[key] = flat[start : start + _numel(shape)].view(shape).clone()
                else:
                    entry[key] = torch.tensor(scalars[k], dtype=torch.float32)
    return {"state": whole, "param_groups": opt["param_groups"]}


def _spans(unit: dict) -> list[tuple[str, tuple, int]]:
    spans, start = [], 0
    for name, shape in zip(unit["names"], unit["shapes"]):
        spans.append((name, tuple(shape), start))
        start += _numel(shape)
    return spans


def _numel(shape: tuple) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _dtype(unit: dict) -> torch.dtype:
    return getattr(torch, unit["dtype"].removeprefix("torch."))
