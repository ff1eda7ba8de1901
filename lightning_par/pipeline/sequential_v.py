"""The drop-in network for interleaved 1F1B and zero bubble (several stages per device).

:class:`PipelinedStages` stands in for the model's ``nn.Sequential`` on every rank, as
:class:`~lightning_par.pipeline.sequential.PipelinedSequential` does for GPipe and 1F1B, with
the same contract towards the strategy: ``train_1f1b`` runs the whole schedule with a
per-micro-batch mean loss (every non-GPipe schedule needs it), the next ``forward`` returns
the output it computed, and ``backward`` hands the gradients over after Lightning zeroed
them. The network is cut into ``K*v`` stages; device ``d`` keeps stages ``d, d+K, ...``
(their layers under their original indices, so state dicts merge into the whole network's),
and runs them on :class:`~lightning_par.pipeline.multistage.DeviceStages`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from lightning_par.comm import Communicator
from lightning_par.pipeline.messages import Kind, read_header, write_header
from lightning_par.pipeline.multistage import DeviceStages
from lightning_par.pipeline.partition import split_sequential
from lightning_par.pipeline.schedule import Step
from lightning_par.pipeline.sequential import PipelinedSequential
from lightning_par.pipeline.step import scheduled_step


def device_layers(net: nn.Sequential, balance: Sequence[int], num_devices: int,
                  device: int) -> dict[int, nn.Sequential]:  # fmt: skip
    """``{stage: its layers}`` of the stages ``device`` holds (round-robin dealing)."""
    stages = split_sequential(net, list(balance))
    return {s: stages[s] for s in range(device, len(stages), num_devices)}


def device_states(net: nn.Sequential, balance: Sequence[int], num_devices: int) -> list[dict]:
    """Each device's state dict in the order :class:`PipelinedStages` lists it."""
    states = []
    for d in range(num_devices):
        state: dict = {}
        for layers in device_layers(net, balance, num_devices, d).values():
            state.update(layers.state_dict())
        states.append(state)
    return states


class PipelinedStages(PipelinedSequential):
    """This rank's stages of ``net`` split by ``balance`` (``K*v`` entries), for the
    ``"interleaved"`` (``v`` stages per device) and ``"zero_bubble"`` (``v = 1``) schedules.

    Args: as :class:`PipelinedSequential`, plus ``virtual_stages`` (``v``).
    """

    def __init__(self, net: nn.Sequential, balance: Sequence[int], comm: Communicator, *,
                 chunks: int, checkpoint: str = "never", schedule: str = "interleaved",
                 virtual_stages: int = 2) -> None:  # fmt: skip
        nn.Module.__init__(self)
        k = comm.world_size
        if len(balance) != k * virtual_stages:
            raise ValueError(f"balance {list(balance)} needs {k} x {virtual_stages} = "
                             f"{k * virtual_stages} stages")  # fmt: skip
        mine = device_layers(net, balance, k, comm.rank)
        for s in sorted(mine):
            for name, layer in mine[s].named_children():
                self.add_module(name, layer)
        self.balance, self.chunks, self.schedule = list(balance), chunks, schedule
        self.virtual_stages = virtual_stages
        self.runtime = DeviceStages(mine, k * virtual_stages, comm, checkpoint=checkpoint,
                                    split_backward=schedule == "zero_bubble")  # fmt: skip
        self._pending: tuple[list[Step], torch.Tensor] | None = None
        self._precomputed: torch.Tensor | None = None
        self._stash: list[tuple[nn.Parameter, torch.Tensor | None]] | None = None
        self.last_loss: torch.Tensor | None = None  # train_1f1b's batch loss (last stage)
        self.active = False

    def extra_repr(self) -> str:
        comm = self.runtime.comm
        return (
            f"device={comm.rank}/{comm.world_size}, stages={sorted(self.runtime.stages)}, "
            f"balance={self.balance}, chunks={self.chunks}, schedule={self.schedule!r}"
        )

    def chunks_for(self, batch_size: int) -> int:
        m = min(self.chunks, batch_size)
        k = self.runtime.comm.world_size
        if self.schedule == "interleaved" and self.virtual_stages > 1:
            if batch_size < k:
                raise ValueError(f"interleaved 1F1B over {k} devices needs batches of >= {k} "
                                 f"samples, got {batch_size}: use drop_last=True")  # fmt: skip
            m -= m % k  # a short last batch: fewer micro-batches, still a multiple of K
        return m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._precomputed_output()
        if out is not None:
            return out
        if torch.is_grad_enabled():
            raise RuntimeError(f"schedule={self.schedule!r} computes the loss per micro-batch: "
                               "call train_1f1b()")  # fmt: skip
        device, m = self.runtime, self.chunks_for(x.shape[0])
        # inference: every stage of the device in order, all micro-batches (deadlock-free:
        # stages only wait for lower stages; every pair sees messages in one order)
        steps = [Step(s, "fwd", i) for s in sorted(device.stages) for i in range(m)]
        device.begin(tuple(x.shape), m)
        device.run(steps, [(t,) for t in x.tensor_split(m)] if 0 in device.stages else None)
        last = device.num_stages - 1 in device.stages
        joined = torch.cat([device.results[i][0] for i in range(m)]) if last else None
        device.finish()
        return share_output(device, joined)

    def train_1f1b(self, x: torch.Tensor, target: torch.Tensor,
                   loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                   scale: float = 1.0) -> torch.Tensor:  # fmt: skip
        """The whole step under this network's schedule (see :meth:`PipelinedSequential.
        train_1f1b` for the contract)."""
        params = [p for p in self.parameters() if p.requires_grad]
        before = [p.grad for p in params]
        for p in params:
            p.grad = None
        m = self.chunks_for(x.shape[0])
        v = self.virtual_stages if self.schedule == "interleaved" else 1
        joined, self.last_loss = scheduled_step(
            self.runtime, x, target, loss_fn, m, self.schedule, v, scale
        )
        self._stash = [(p, p.grad) for p in params]
        for p, grad in zip(params, before):
            p.grad = grad
        out = share_output(self.runtime, joined)
        self._precomputed = out.detach().requires_grad_(out.is_floating_point())
        return out


def share_output(device: DeviceStages, output: torch.Tensor | None) -> torch.Tensor:
    """The device holding the last stage sends the joined output to every other device
    (a header, then the tensor); returns it on every device."""
    comm, src = device.comm, device.device_of(device.num_stages - 1)
    if comm.rank == src:
        assert output is not None
        out = output.detach().contiguous()
        handles = []
        for dst in range(comm.world_size):
            if dst != src:
                header = write_header((out,)).to(out.device)
                handles.append(comm.isend(header, dst, tag=Kind.HEADER))
                handles.append(comm.isend(out, dst, tag=Kind.OUTPUT))
        for h in handles:
            h.wait()
        return out
    dev = device._device()
    header = comm.recv(torch.empty_like(write_header(())).to(dev), src, tag=Kind.HEADER)
    ((shape, dtype),) = read_header(header.cpu())
    return comm.recv(torch.empty(shape, dtype=dtype, device=dev), src, tag=Kind.OUTPUT)
