"""The stacked-RNN wavefront: recurrent layers on K processes, the sequence streamed through
them in chunks of ``time_chunk`` steps.

Slides 003 ("Model Parallelization"): with one RNN layer per device, "at the first step only
one device is active, at the second step two ... by the time the signal propagates to the
output layer, all devices are active simultaneously". Here stage ``k`` runs time chunk ``t``
while stage ``k + 1`` runs chunk ``t - 1``; each stage carries its layers' hidden state from
chunk to chunk (:class:`~lightning_par.modelparallel.recurrent.CarriedState`). Backward runs
the same wavefront in reverse: chunk ``t``'s backward needs the gradient of its outputs (from
stage ``k + 1``) and of its final state (from this stage's backward of chunk ``t + 1``).

This is GPipe's schedule (:mod:`lightning_par.pipeline.schedule`) with time chunks in place
of micro-batches, so the pipeline runtime (:class:`~lightning_par.pipeline.multistage.
DeviceStages`, one stage per device), traces and timelines are reused as they are.
With ``T`` chunks and ``K`` equal stages a stage is busy ``T / (T + K - 1)`` of the step;
``time_chunk=None`` (one chunk) is the naive layer split, busy ``1 / K``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from lightning_par.comm import Communicator
from lightning_par.modelparallel.recurrent import CarriedState, is_recurrent
from lightning_par.pipeline.multistage import DeviceStages
from lightning_par.pipeline.partition import check_balance, split_sequential
from lightning_par.pipeline.schedule import Step, bubble_fraction, unit_time_table
from lightning_par.pipeline.schedules import GPIPE
from lightning_par.split import balance_by_cost


# ---- the schedule, without processes ---------------------------------------------------------
def time_chunk_sizes(seq_len: int, time_chunk: int | None) -> list[int]:
    """Lengths of the time chunks of a ``seq_len``-step sequence (the last may be shorter);
    ``None`` is one chunk of the whole sequence."""
    if seq_len < 1:
        raise ValueError(f"sequence length must be >= 1, got {seq_len}")
    if time_chunk is None:
        return [seq_len]
    if time_chunk < 1:
        raise ValueError(
            f"time_chunk must be >= 1 (or None for the whole sequence), got {time_chunk}"
        )
    full, rest = divmod(seq_len, time_chunk)
    return [time_chunk] * full + ([rest] if rest else [])


def wavefront_steps(num_stages: int, num_chunks: int) -> list[list[Step]]:
    """Each stage's steps: forwards of chunks ``0..T-1``, then backwards ``T-1..0``."""
    return GPIPE.steps(num_stages, num_chunks)


def wavefront_grid(num_stages: int, num_chunks: int) -> list[list[int | None]]:
    """The forward wavefront on an ideal machine: ``grid[slot][stage]`` is the chunk a stage
    runs in that time slot (``None``: idle)."""
    table = unit_time_table(wavefront_steps(num_stages, num_chunks))
    rows = [
        [s.micro_batch if s is not None and s.op == "fwd" else None for s in row] for row in table
    ]
    return [row for row in rows if any(c is not None for c in row)]


def wavefront_utilisation(num_stages: int, num_chunks: int) -> float:
    """Busy share of each stage with equal unit-time chunks: ``T / (T + K - 1)``."""
    return 1.0 - bubble_fraction(num_stages, num_chunks)


# ---- cutting the network -------------------------------------------------------------------
def _check_stages(stages: int, recurrent: int) -> None:
    if stages > recurrent:
        raise ValueError(
            f"{stages} stages but only {recurrent} recurrent layers: with time_chunk every "
            f"stage needs a recurrent layer, so use at most {recurrent} stages"
        )


def _recurrent_span(net: nn.Sequential) -> tuple[int, int]:
    flags = [is_recurrent(layer, i) for i, layer in enumerate(net)]
    rec = [i for i, f in enumerate(flags) if f]
    if not rec:
        raise ValueError("time_chunk needs recurrent layers (nn.LSTM/GRU/RNN) in the network")
    lo, hi = rec[0], rec[-1] + 1
    if not all(flags[lo:hi]):
        gap = next(i for i in range(lo, hi) if not flags[i])
        raise ValueError(
            f"layer {gap} ({type(net[gap]).__name__}) sits between recurrent layers: the "
            "wavefront needs the recurrent layers consecutive"
        )
    return lo, hi


def recurrent_parts(net: nn.Sequential, balance: Sequence[int]) -> list[tuple[int, int, int]]:
    """Per stage ``(first_recurrent, stop_recurrent, stop)`` layer indices: layers before the
    first recurrent one (e.g. an input reshape) run on stage 0 on the whole sequence, layers
    after the last one (e.g. a classifier) on the last stage; raises ``ValueError`` for a
    network or balance the wavefront cannot run."""
    check_balance(len(net), balance)
    lo, hi = _recurrent_span(net)
    _check_stages(len(balance), hi - lo)
    parts, start = [], 0
    for size in balance:
        stop = start + size
        first, last = max(start, lo), min(stop, hi)
        if first >= last:
            raise ValueError(
                f"balance {list(balance)} gives a stage (layers {start}..{stop - 1}) no "
                "recurrent layer; with time_chunk every stage needs one"
            )
        parts.append((first, last, stop))
        start = stop
    return parts


def wavefront_balance(net: nn.Sequential, num_stages: int) -> list[int]:
    """Layers per stage balancing the recurrent layers' parameter counts over ``num_stages``
    stages, with the layers before (after) them on the first (last) stage."""
    lo, hi = _recurrent_span(net)
    _check_stages(num_stages, hi - lo)
    counts = [sum(p.numel() for p in layer.parameters()) for layer in net[lo:hi]]
    balance = balance_by_cost([max(1, c) for c in counts], num_stages)
    balance[0] += lo
    balance[-1] += len(net) - hi
    return balance


class WavefrontSequential(nn.Module):
    """This rank's stage of a stacked RNN ``net``, standing in for the whole ``net``.

    ``forward(x)`` runs the forward wavefront on every stage and returns the network's output
    on all of them (a leaf in training); after the loss's backward, :meth:`backward` runs the
    backward wavefront. Layer names are the original indices, so stage state dicts merge.
    """

    def __init__(
        self, net: nn.Sequential, balance: Sequence[int], comm: Communicator,
        time_chunk: int | None,
    ) -> None:  # fmt: skip
        super().__init__()
        if len(balance) != comm.world_size:
            raise ValueError(
                f"balance {list(balance)} needs {len(balance)} ranks, got {comm.world_size}"
            )
        first, last, stop = recurrent_parts(net, balance)[comm.rank]
        start = stop - list(balance)[comm.rank]
        for name, layer in split_sequential(net, balance)[comm.rank].named_children():
            self.add_module(name, layer)
        # a tuple, not submodules: the layers are registered above under their own names
        self._ends = (net[start:first], net[last:stop])
        self.time_chunk, self.balance = time_chunk, list(balance)
        # the recurrent layers are this device's one stage; the layers before (after) them run
        # on the whole sequence, on the first (last) device
        carried = CarriedState(list(net[first:last]))
        self.runtime = DeviceStages({comm.rank: carried}, comm.world_size, comm)
        self._seq_len: dict[tuple, int] = {}
        self._pending: tuple | None = None
        self._pre = self._post = None
        self.active = False  # set around steps, when every stage runs forward

    def extra_repr(self) -> str:
        comm = self.runtime.comm
        return f"stage={comm.rank}/{comm.world_size}, time_chunk={self.time_chunk}"

    def _sequence_length(self, x: torch.Tensor, h: torch.Tensor | None) -> int:
        # stage 0 learns the length from its input layers and tells the others (once per shape)
        stage, key = self.runtime, tuple(x.shape)
        if key not in self._seq_len:
            box = torch.tensor([h.shape[1] if h is not None else 0], device=stage.device)
            if stage.is_first:
                for dst in range(1, stage.num_stages):
                    stage.comm.send(box, dst, tag="seq_len")
            else:
                stage.comm.recv(box, 0, tag="seq_len")
            self._seq_len[key] = int(box.item())
        return self._seq_len[key]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.active:
            raise RuntimeError(
                "this network is split over processes; it only runs inside the Trainer's steps "
                "(or with .active = True on every stage at once)"
            )
        stage, training = self.runtime, torch.is_grad_enabled()
        if self._pending is not None:  # a previous step never ran backward: drop it
            self._pending = None
            stage.finish()
        inputs, h, self._pre = None, None, None
        if stage.is_first:
            h = self._ends[0](x)
            if training and h.requires_grad:  # the chunks' gradients gather on a leaf
                self._pre = (h, h.detach().requires_grad_(True))
                h = self._pre[1]
        seq_len = self._sequence_length(x, h)
        sizes = time_chunk_sizes(seq_len, self.time_chunk)
        stage.begin((x.shape[0], seq_len, self.time_chunk), len(sizes))
        stage.stages[stage.comm.rank].reset()  # the carried state starts anew
        if stage.is_first:
            inputs = [(c,) for c in torch.split(h, sizes, dim=1)]
        stage.run(self._steps(len(sizes))[: len(sizes)], inputs)
        out = None
        if stage.is_last:
            seq = torch.cat([stage.results[i][0] for i in range(len(sizes))], dim=1)
            seq.requires_grad_(training)
            self._post = (seq, self._ends[1](seq))
            out = [self._post[1]]
        out = stage.share_output(out)[0]
        if not training:
            stage.finish()
            return out
        leaf = out.detach().requires_grad_(out.is_floating_point())
        self._pending = (leaf, sizes)
        return leaf

    def _steps(self, num_chunks: int) -> list[Step]:
        return wavefront_steps(self.runtime.num_stages, num_chunks)[self.runtime.comm.rank]

    def backward(self) -> None:
        """The backward wavefront, with the gradient the loss left on the output."""
        if self._pending is None:
            return
        (leaf, sizes), self._pending = self._pending, None
        stage, grads = self.runtime, None
        if stage.is_last:
            seq, out = self._post
            grad = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
            torch.autograd.backward(out, grad)
            seq_grad = seq.grad if seq.grad is not None else torch.zeros_like(seq)
            grads = torch.split(seq_grad, sizes, dim=1)
        stage.run(self._steps(len(sizes))[len(sizes) :], output_grad=lambda i, _: [grads[i]])
        if self._pre is not None and self._pre[1].grad is not None:
            self._pre[0].backward(self._pre[1].grad)
        self._pre = self._post = None
        stage.finish()


def train_step(
    piped: WavefrontSequential, x: torch.Tensor, target: torch.Tensor, loss_fn
) -> torch.Tensor:
    """One forward and backward on every stage (each calls it with the same batch), as
    Lightning runs it: the loss on the shared output, then the backward wavefront."""
    piped.active = True
    try:
        loss = loss_fn(piped(x), target)
        loss.backward()
        piped.backward()
    finally:
        piped.active = False
    return loss.detach()
