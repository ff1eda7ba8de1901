"""A network built on the ``meta`` device, given real storage stage by stage.

``with torch.device("meta"): model = Net()`` (or Lightning's
``trainer.init_module(empty_init=True)`` under a pipeline strategy) builds a network
without memory. A pipeline device then gives storage only to the modules its stages use and
initialises them with their own ``reset_parameters()``, each from a seed derived from the
module's name (and Lightning's global seed), so every device, and one process calling
:func:`materialize` on the whole network, draws the same values for the same module: no
device ever holds the whole network, and the result does not depend on which device holds
what. The modules of other stages get empty tensors.

A tensor that ``reset_parameters()`` cannot restore (a raw ``nn.Parameter`` of a module
without that method, a buffer computed in ``__init__`` such as a positional table) is
refused by name: build such a network on a real device.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Collection, Iterator

import torch
from torch import nn


def has_meta(net: nn.Module) -> bool:
    return any(t.is_meta for t in [*net.parameters(), *net.buffers()])


def _seed(name: str) -> int:
    return (int(os.environ.get("PL_GLOBAL_SEED", "0")) + zlib.crc32(name.encode())) % 2**63


def _restorable(module: nn.Module) -> bool:
    return callable(getattr(module, "reset_parameters", None))


def materialize(
    net: nn.Module, keep: Collection[str] | None = None, device: torch.device | str = "cpu"
) -> None:
    """Give real storage on ``device`` to the parameters and buffers of ``net`` named in
    ``keep`` (all when ``None``), initialised by their modules' ``reset_parameters()``; the
    others become empty tensors. Refuses, before changing anything, a kept meta tensor whose
    module cannot reset it."""
    modules = dict(net.named_modules())
    owned = []  # (module name, module, local tensor name, full name, is parameter)
    for prefix, module in modules.items():
        for kind, tensors in (("param", module._parameters), ("buffer", module._buffers)):
            for local, t in tensors.items():
                if t is not None and t.is_meta:
                    full = f"{prefix}.{local}" if prefix else local
                    owned.append((prefix, module, local, full, kind == "param"))
    kept = {o[0] for o in owned if keep is None or o[3] in keep}
    stuck = [o[3] for o in owned if o[0] in kept and not _restorable(o[1])]
    if stuck:
        raise ValueError(
            f"built on the meta device, {', '.join(stuck[:4])} cannot be initialised stage "
            "by stage: its module has no reset_parameters(). Build the network on a real "
            "device, or give that module a reset_parameters()"
        )
    device = torch.device(device)
    for prefix, module, local, _, is_param in owned:
        if prefix in kept:
            continue
        empty = torch.empty(0, dtype=getattr(module, local).dtype, device=device)
        if is_param:
            module._parameters[local] = nn.Parameter(empty, getattr(module, local).requires_grad)
        else:
            module._buffers[local] = empty
    for prefix in sorted(kept):
        module = modules[prefix]
        module.to_empty(device=device, recurse=False)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(_seed(prefix))
            module.reset_parameters()


def named_tensors(net: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter and buffer of ``net`` by name, tied ones under each of their names."""
    yield from net.named_parameters(remove_duplicate=False)
    yield from net.named_buffers(remove_duplicate=False)


def release(net: nn.Module, keep: Collection[str]) -> None:
    """Empty every parameter and buffer of ``net`` not named in ``keep`` (storage freed; the
    ``Parameter`` objects stay, so an optimiser over the whole network never steps them)."""
    for name, t in list(named_tensors(net)):
        if name not in keep and t.numel():
            t.data = torch.empty(0, dtype=t.dtype, device=t.device)
