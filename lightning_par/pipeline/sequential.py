"""A pipelined ``nn.Sequential``: the drop-in network each stage process holds.

:class:`PipelinedSequential` replaces a model's ``nn.Sequential`` on every rank. It keeps
only this rank's layers, under their original indices (so state dicts of all stages merge
into the original network's), and its ``forward(x)`` runs the whole pipeline: every stage
calls it with the same batch, stage 0 feeds the micro-batches in, the last stage joins the
outputs, and all stages return the joined output. The user's code after ``self.net(x)``
(loss, metrics, logging) therefore runs unchanged, and on real values, on every rank.

Training with GPipe: ``forward`` runs the forward half of the schedule and returns the
output as a leaf tensor; the user's ``loss.backward()`` fills its gradient; then
:meth:`backward` runs the backward half with that gradient, cut per micro-batch.
Training with 1F1B: :meth:`train_1f1b` runs the interleaved schedule with a per-micro-batch
loss first, and the next ``forward`` returns the output it computed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from lightning_par.comm import Communicator
from lightning_par.pipeline.partition import split_sequential
from lightning_par.pipeline.runtime import PipelineStage
from lightning_par.pipeline.schedule import Step
from lightning_par.pipeline.step import backward_half, forward_half, one_f_one_b


class PipelinedSequential(nn.Module):
    """This rank's stage of ``net`` split by ``balance``, standing in for the whole ``net``.

    Args:
        net: the full network (every rank builds it; each keeps only its stage's layers).
        balance: layers per stage, one stage per rank of ``comm``.
        comm: the stages' communicator (stage = group rank).
        chunks: micro-batches per batch (``1``: the naive layer-per-device split).
        checkpoint: re-materialisation mode (see :mod:`lightning_par.pipeline.checkpoint`).
        schedule: ``"gpipe"`` or ``"1f1b"`` for training; inference always runs forwards only.
    """

    def __init__(
        self,
        net: nn.Sequential,
        balance: Sequence[int],
        comm: Communicator,
        *,
        chunks: int,
        checkpoint: str = "except_last",
        schedule: str = "gpipe",
    ) -> None:
        super().__init__()
        if len(balance) != comm.world_size:
            raise ValueError(
                f"balance {list(balance)} needs {len(balance)} ranks, got {comm.world_size}"
            )
        stage_layers = split_sequential(net, balance)[comm.rank]
        for name, layer in stage_layers.named_children():
            self.add_module(name, layer)
        self.balance, self.chunks, self.schedule = list(balance), chunks, schedule
        # a plain object, not a submodule: its Sequential shares this module's layers
        self.runtime = PipelineStage(stage_layers, comm, checkpoint=checkpoint)
        self._pending: tuple[list[Step], torch.Tensor] | None = None
        self._precomputed: torch.Tensor | None = None
        self._stash: list[tuple[nn.Parameter, torch.Tensor | None]] | None = None
        self.last_loss: torch.Tensor | None = None  # train_1f1b's batch loss (last stage)
        self.active = False  # set by the strategy around steps, when every stage runs forward

    def extra_repr(self) -> str:
        return (
            f"stage={self.runtime.stage}/{self.runtime.num_stages}, balance={self.balance}, "
            f"chunks={self.chunks}, schedule={self.schedule!r}, "
            f"checkpoint={self.runtime.checkpoint!r}"
        )

    def chunks_for(self, batch_size: int) -> int:
        return min(self.chunks, batch_size)  # a short last batch gets fewer micro-batches

    def _precomputed_output(self) -> torch.Tensor | None:
        """The output :meth:`train_1f1b` computed (once); otherwise ``None``, after checking
        that every stage runs this forward (inside the Trainer's steps)."""
        if self._precomputed is not None:
            out, self._precomputed = self._precomputed, None
            return out
        if not self.active:
            raise RuntimeError(
                "this network is split into pipeline stages over processes; it can only run "
                "inside the Trainer's training/validation/test/predict steps, where every stage "
                "calls it with the same batch"
            )
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._precomputed_output()
        if out is not None:
            return out
        if self._pending is not None:  # a previous step never ran backward: drop it
            self._pending = None
            self.runtime.finish()
        training = torch.is_grad_enabled()
        if training and self.schedule != "gpipe":
            raise RuntimeError(
                f"schedule={self.schedule!r} computes the loss per micro-batch: call train_1f1b()"
            )
        steps, joined = forward_half(self.runtime, x, self.chunks_for(x.shape[0]))
        out = self.runtime.share_output(joined)
        if not training:
            self.runtime.finish()
            return out
        leaf = out.detach().requires_grad_(out.is_floating_point())
        self._pending = (steps, leaf)
        return leaf

    def backward(self) -> None:
        """Run the backward half of a GPipe step with the gradient the user's loss left on
        the output; after :meth:`train_1f1b`, add the gradients it computed."""
        if self._stash is not None:  # 1F1B: hand over the gradients train_1f1b computed
            for param, grad in self._stash:
                if grad is not None:
                    param.grad = grad if param.grad is None else param.grad.add_(grad)
            self._stash = None
        if self._pending is None:
            return
        steps, leaf = self._pending
        self._pending = None
        backward_half(self.runtime, steps, leaf.grad if self.runtime.is_last else None)

    def train_1f1b(
        self,
        x: torch.Tensor,
        target: torch.Tensor,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        scale: float = 1.0,
    ) -> torch.Tensor:
        """Forward and backward under 1F1B with the mean-reduced ``loss_fn`` per micro-batch
        (micro-batch ``i`` back-propagates ``scale * n_i / B * loss_fn(out_i, y_i)``); the next
        ``forward`` returns the joined output, which is also returned here. The parameter
        gradients are added to ``.grad`` by the following :meth:`backward` call."""
        stage = self.runtime
        # Lightning zeroes gradients between training_step and backward: keep this step's
        # gradients aside and hand them over in backward()
        params = [p for p in self.parameters() if p.requires_grad]
        before = [p.grad for p in params]
        for p in params:
            p.grad = None
        joined, self.last_loss = one_f_one_b(
            stage, x, target, loss_fn, self.chunks_for(x.shape[0]), scale
        )
        self._stash = [(p, p.grad) for p in params]
        for p, grad in zip(params, before):
            p.grad = grad
        out = stage.share_output(joined)
        stage.finish()
        self._precomputed = out.detach().requires_grad_(out.is_floating_point())
        return out
