"""Parameters tied across pipeline devices (e.g. an embedding shared with the output layer).

Every device whose stages use a tied parameter holds it; after each backward its gradients
are summed over those devices (DeepSpeed's ``TiedLayerSpec``), so the copies stay equal. In
a global norm (clipping) each counts once, on the first device holding it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from lightning_par.comm import Communicator
from lightning_par.graphcut import GraphSplit


class TiedParameters:
    """The tied parameters of ``net`` cut as ``split`` over ``num_devices`` devices (stage
    ``s`` on device ``s % num_devices``), by the network's parameter names."""

    def __init__(self, net: nn.Module, split: GraphSplit, num_devices: int) -> None:
        named = {id(p): n for n, p in net.named_parameters()}
        #: tied parameter name -> the devices whose stages use it
        self.holders: dict[str, tuple[int, ...]] = {}
        for stage_name, stages in split.shared.items():
            param = split.stages[stages[0]].module.get_parameter(stage_name)
            devices = tuple(sorted({s % num_devices for s in stages}))
            if len(devices) > 1:
                self.holders[named[id(param)]] = devices
        self.shapes = {n: p.shape for n, p in net.named_parameters() if n in self.holders}

    def counted_elsewhere(self, rank: int) -> set[str]:
        """The tied parameters whose gradient another device counts in a global norm."""
        return {n for n, devices in self.holders.items() if devices[0] != rank}

    def sum_gradients(self, net: nn.Module, comm: Communicator, local: set[str]) -> None:
        """Each tied parameter's gradient becomes the sum over the devices that use it (an
        allreduce over the pipeline's devices: the others add zeros); ``local``: the
        parameter names this device holds."""
        if not self.holders or comm.world_size == 1:
            return
        params = dict(net.named_parameters())
        for name in sorted(self.holders):
            p = params[name]
            if not p.requires_grad:
                continue
            mine = name in local and p.grad is not None
            grad = (
                p.grad if mine else torch.zeros(self.shapes[name], dtype=p.dtype, device=p.device)
            )
            dist.all_reduce(grad, group=comm.group)
            if name in local and p.grad is None:  # its stages had no gradient
                p.grad = grad
