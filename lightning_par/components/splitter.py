"""The model-splitting component: what every strategy that cuts one model over several ranks
does at Lightning's hooks, with nothing to do by default.

A :class:`ModelSplitter` has one job: cut the LightningModule's network over the ranks of
one communicator (the strategy's :attr:`~lightning_par.strategies._base.ParStrategy.split_comm`:
every rank, or one model-parallel row of the hybrid grid) and run the pieces. What it reads
from the strategy is a :class:`SplitContext` (the module, communicator, devices, precision
and rank), not the strategy itself. The strategy
holds one in :attr:`~lightning_par.strategies._base.ParStrategy.splitter` and calls it from
its hooks (``prepare_model``, ``training_step``, ``backward``, checkpoints, ...), the way
Lightning's own strategies hold a precision plugin and a checkpoint I/O object
(composition rather than inheritance: Gamma et al., *Design Patterns*, 1994, "favour object
composition over class inheritance").

The implementations: :class:`~lightning_par.components.pipeline_split.PipelineSplit`
(pipeline stages of any network, the naive layer-wise split),
:class:`~lightning_par.components.wavefront_split.WavefrontSplit` (the recurrent wavefront) and
:class:`~lightning_par.components.tensor_split.TensorParallelSplit` (Megatron shards).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Protocol

import lightning.pytorch as pl
import torch
from torch import nn

from lightning_par.comm import Communicator
from lightning_par.pipeline.materialize import has_meta, materialize


class SplitContext(Protocol):
    """Everything a splitter reads from the strategy that holds it, and nothing else (as
    torchgpipe's ``Pipeline`` takes its partitions and devices, not its owner). Each is read
    when needed: Lightning fills them in while it sets the strategy up (the module when it
    connects it, the communicator at setup, the devices and precision from the Trainer).
    :class:`~lightning_par.strategies._split_context.StrategyContext` reads them from a
    :class:`~lightning_par.strategies._base.ParStrategy`."""

    @property
    def name(self) -> str:
        """The strategy's registered name, for messages."""

    @property
    def module(self) -> pl.LightningModule:
        """The LightningModule whose network is split."""

    @property
    def comm(self) -> Communicator | None:
        """The ranks one model is split over (``None`` before setup)."""

    @property
    def size(self) -> int:
        """How many pieces one model is cut into."""

    @property
    def rank(self) -> int:
        """This process's global rank."""

    @property
    def devices(self) -> list[torch.device]:
        """The devices of the job's processes on this node (empty before they are known)."""

    @property
    def root_device(self) -> torch.device:
        """This process's device."""

    @property
    def precision(self) -> Any:
        """Lightning's precision plugin (gradient scaler, clipping, main parameters)."""

    @property
    def backend(self) -> str | None:
        """The process group backend asked for (``None``: by device)."""

    @property
    def sync_batchnorm(self) -> bool:
        """Whether ``Trainer(sync_batchnorm=True)`` was asked for."""

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""


class ModelSplitter:
    """Base of the model splitters: every method is a no-op or returns its input unchanged.

    :meth:`bind` gives the splitter its :class:`SplitContext`: the communicator, devices,
    precision plugin and rank it reads.
    """

    #: The name used in messages (the strategy's registered name once bound).
    name = "split"
    #: Whether a model built on the meta device gets storage piece by piece here.
    materializes_meta = False

    def __init__(self) -> None:
        self.context: SplitContext | None = None

    def bind(self, context: SplitContext) -> None:
        """Read the strategy's communicator, devices, precision and rank from ``context``."""
        self.context = context

    # ---- where the pieces live --------------------------------------------------------------
    @property
    def comm(self) -> Communicator:
        """The ranks that share one model (stage or shard index = rank in it)."""
        assert self.context is not None, "the splitter is not bound to a strategy"
        comm = self.context.comm
        assert comm is not None, "the strategy has not been set up yet"
        return comm

    @property
    def size(self) -> int:
        """How many pieces the model is cut into."""
        return self.context.size

    @property
    def module(self) -> pl.LightningModule:
        return self.context.module

    # ---- before launch and at setup ---------------------------------------------------------
    def check_before_launch(self, trainer: pl.Trainer | None) -> None:
        """Reject what this split cannot run exactly, before any rank starts."""

    def materialize_whole(self, module: pl.LightningModule | None) -> None:
        """Storage for a model built on the meta device, at ``setup``, in the dtype it was
        built in and before precision or SyncBatchNorm conversion: each network by its own
        names, as the pipelines do, so the values are one process's ``materialize(network)``.
        Nothing here for a splitter that :attr:`materializes_meta` (stage by stage, later)."""
        if module is not None and not self.materializes_meta and has_meta(module):
            for child in module.children():
                materialize(child)
            materialize(module)

    def split(self, trainer: pl.Trainer) -> None:
        """Cut the network (``prepare_model``: before it moves to its device)."""

    def after_setup(self, trainer: pl.Trainer) -> None:
        """After the optimisers and the precision plugin are set up."""

    def explain_optimizer_error(self, error: ValueError) -> ValueError | None:
        """A clearer error for an optimiser that failed to build on this piece, or None."""
        return None

    @contextmanager
    def optimizer_errors_explained(self) -> Iterator[None]:
        """While the optimisers are built: a ``ValueError`` raised again as
        :meth:`explain_optimizer_error`'s clearer one, where it has one."""
        try:
            yield
        except ValueError as err:
            better = self.explain_optimizer_error(err)
            if better is None:
                raise
            raise better from err

    # ---- steps ----------------------------------------------------------------------------
    def before_training_step(self, batch: Any) -> None:
        """Checks (and work such as 1F1B's whole schedule) before the user's step."""

    @contextmanager
    def running(self) -> Iterator[None]:
        """Around every training/validation/test/predict step."""
        yield

    def before_backward(self, closure_loss: Any) -> None:
        """Before Lightning's backward of ``closure_loss`` (the loss the step returned, divided
        by ``accumulate_grad_batches``, not yet multiplied by a gradient scaler)."""

    def after_backward(self) -> None:
        """After Lightning's backward of the loss (e.g. the pipeline's backward half)."""

    def after_optimizer_step(self, optimizer: Any) -> None:
        """After each optimiser step."""

    def micro_batched_runtime(self) -> Any:
        """The stage whose micro-batches leave gradients partial until the last one, or None:
        gradients are complete as soon as autograd writes them."""
        return None

    def early_buckets_exact(self) -> bool:
        """Whether a bucket started in the last micro-batch's backward holds its whole
        gradient."""
        return True

    # ---- checkpoints ----------------------------------------------------------------------
    def full_state_dict(self, local: dict[str, Any]) -> dict[str, Any]:
        """The whole model's state dict (on rank 0) from this piece's ``local`` one."""
        return local

    def piece_state_dict(self, full: Mapping[str, Any]) -> Mapping[str, Any]:
        """This piece's part of a whole model's state dict."""
        return full

    def full_optimizer_state(self, local: dict[str, Any], optimizer: Any) -> dict[str, Any]:
        """The whole model's optimiser state in one process's format (on rank 0)."""
        return local

    def load_optimizer_states(self, optimizers: list[Any], states: list[Any]) -> bool:
        """Load this piece's part of whole-model optimiser states; False: not handled."""
        return False


def find_network(module: pl.LightningModule, module_attr: str | None, who: str) -> str:
    """The attribute holding the network: ``module_attr``, else ``net`` if there is one, else
    the only child module with parameters; a clear error otherwise."""
    if module_attr is not None:
        if not isinstance(getattr(module, module_attr, None), nn.Module):
            raise TypeError(
                f"{who}: `{type(module).__name__}.{module_attr}` is not an nn.Module; pass "
                "module_attr='<the attribute holding your network>'"
            )
        return module_attr
    children = [n for n, c in module.named_children() if any(True for _ in c.parameters())]
    if "net" in children or len(children) == 1:
        return "net" if "net" in children else children[0]
    raise TypeError(
        f"{who} cuts one network of {type(module).__name__} into stages, but it holds "
        f"{len(children)} modules with parameters ({', '.join(children) or 'none'}): pass "
        "module_attr='<the attribute holding your network>'"
    )
