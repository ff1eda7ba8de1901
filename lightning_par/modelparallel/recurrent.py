"""Recurrent layers whose hidden state is carried from one time chunk to the next.

The wavefront (course slides 003, "Model Parallelization": an RNN split horizontally, one
layer per device) needs each stage to run its layers on a *piece* of the sequence and to
resume on the next piece from the hidden state it stopped at. A layer qualifies when it is
a unidirectional, ``batch_first`` ``nn.RNN``/``nn.GRU``/``nn.LSTM``, or a module wrapping
one that offers ``forward_chunk(x, state) -> (output, state)``.

:class:`CarriedState` runs a stage's recurrent layers chunk after chunk. In training the
state entering chunk ``t`` is a fresh leaf (so chunk ``t``'s graph ends there); when chunk
``t + 1`` has run its backward, the gradient on that leaf is handed to chunk ``t``'s output
state by :class:`_CarryGrad`, inside chunk ``t``'s own backward. Backward therefore runs
chunk by chunk in reverse, each once, as back-propagation through time does.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

State = tuple[torch.Tensor, ...]


class RecurrentLayer(nn.Module):
    """One ``nn.RNN``/``nn.GRU``/``nn.LSTM`` (``kind``) returning only its outputs
    ``[B, T, H]``, so that layers stack in an ``nn.Sequential``."""

    KINDS = {"rnn": nn.RNN, "gru": nn.GRU, "lstm": nn.LSTM}

    def __init__(self, kind: str, input_size: int, hidden_size: int, **kwargs) -> None:
        super().__init__()
        if kind not in self.KINDS:
            raise ValueError(f"unknown recurrent kind {kind!r}: choose one of {list(self.KINDS)}")
        self.rnn = self.KINDS[kind](input_size, hidden_size, batch_first=True, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rnn(x)[0]

    def forward_chunk(self, x: torch.Tensor, state):
        return self.rnn(x, state)


def stacked_rnn(kind: str, sizes: Sequence[int], **kwargs) -> nn.Sequential:
    """``len(sizes) - 1`` stacked :class:`RecurrentLayer` s, layer ``i`` mapping ``sizes[i]``
    features to ``sizes[i + 1]``."""
    return nn.Sequential(
        *[RecurrentLayer(kind, a, b, **kwargs) for a, b in zip(sizes[:-1], sizes[1:])]
    )


def _inner_rnn(layer: nn.Module) -> nn.RNNBase | None:
    if isinstance(layer, nn.RNNBase):
        return layer
    found = [m for m in layer.modules() if isinstance(m, nn.RNNBase)]
    return found[0] if found else None


def is_recurrent(layer: nn.Module, index: int | str = "?") -> bool:
    """Whether ``layer`` is recurrent; raises ``ValueError`` when it is recurrent but its
    state cannot be carried between time chunks."""
    rnn = _inner_rnn(layer)
    if rnn is None:
        return False
    where = f"layer {index} ({type(layer).__name__})"
    if not isinstance(layer, nn.RNNBase) and not hasattr(layer, "forward_chunk"):
        raise ValueError(
            f"{where} wraps a {type(rnn).__name__} but has no forward_chunk(x, state) -> "
            "(output, state): its hidden state cannot be carried between time chunks"
        )
    if rnn.bidirectional:
        raise ValueError(
            f"{where} is bidirectional: its backward direction needs the end of the sequence "
            "first, so its state cannot be carried forward chunk by chunk; use "
            "bidirectional=False or time_chunk=None"
        )
    if not rnn.batch_first:
        raise ValueError(f"{where} needs batch_first=True (sequences are cut along dim 1)")
    return True


def _run(layer: nn.Module, x: torch.Tensor, state: State | None) -> tuple[torch.Tensor, State]:
    rnn = _inner_rnn(layer)
    hx = None if state is None else (state if isinstance(rnn, nn.LSTM) else state[0])
    step = layer if isinstance(layer, nn.RNNBase) else layer.forward_chunk
    out, new = step(x, hx)
    return out, tuple(new) if isinstance(new, tuple) else (new,)


class _CarryGrad(torch.autograd.Function):
    """Identity on the chunk output; its backward also sends the gradient of the next
    chunk's input state into this chunk's output state."""

    @staticmethod
    def forward(ctx, carry: CarriedState, t: int, out: torch.Tensor, *state: torch.Tensor):
        ctx.carry, ctx.t = carry, t
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return (None, None, grad, *ctx.carry.state_grads(ctx.t))


class CarriedState(nn.Module):
    """A stage's recurrent layers run one time chunk per call, carrying the hidden state.

    Call :meth:`reset` before each sequence; then call the module on chunks ``0, 1, ...`` in
    order. The layers are held, not registered (they belong to the stage's network).
    """

    def __init__(self, layers: Sequence[nn.Module]) -> None:
        super().__init__()
        for i, layer in enumerate(layers):
            is_recurrent(layer, i)
        self._layers = list(layers)
        self.reset()

    def parameters(self, recurse: bool = True):  # the held layers' parameters
        for layer in self._layers:
            yield from layer.parameters(recurse)

    def reset(self) -> None:
        self._state: list[State | None] = [None] * len(self._layers)
        self._leaves: list[list[torch.Tensor]] = []  # per chunk: the input-state leaves
        self.chunks_run = 0

    def state_grads(self, t: int) -> list[torch.Tensor | None]:
        """Gradients w.r.t. chunk ``t``'s output state: those on chunk ``t + 1``'s input
        leaves (``None`` after the last chunk, whose final state nothing uses)."""
        if t + 1 >= len(self._leaves):
            return [None] * sum(len(s) for s in self._state if s is not None)
        return [leaf.grad for leaf in self._leaves[t + 1]]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t, self.chunks_run = self.chunks_run, self.chunks_run + 1
        grad = torch.is_grad_enabled()
        leaves, outs = [], []
        for j, layer in enumerate(self._layers):
            state = self._state[j]
            if state is not None:
                state = tuple(s.detach().requires_grad_(grad) for s in state)
                leaves.extend(state)
            x, new = _run(layer, x, state)
            self._state[j] = new
            outs.extend(new)
        if not grad:
            return x
        self._leaves.append(leaves)
        return _CarryGrad.apply(self, t, x, *outs)
