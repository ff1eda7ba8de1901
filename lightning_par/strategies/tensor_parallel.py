"""Tensor (intra-layer) parallelism as a Lightning strategy: each layer's weight cut across
the devices (Megatron-LM, Shoeybi et al., 2019, arXiv:1909.08053).

Every rank reads the same batches (no distributed sampler; checked every step by one small
allreduce, so an unseeded shuffle under popen fails loudly) and holds a slice of each split
layer: :func:`lightning_par.tensorparallel.parallelize` cuts ``module.<module_attr>`` by the
automatic plan (column -> row pairs of consecutive Linear/Conv2d layers with activations,
norms and dropout between, attention by heads, embeddings by vocabulary, LSTMs by hidden
units) or the user's ``plan``, after every rank has taken rank 0's weights and random state
(so dropout draws one process's masks: :mod:`lightning_par.tensorparallel.random`). The operators
``f``/``g`` keep every activation exact, and the layers left whole get the same gradient on
every rank, so there is nothing to synchronise after backward and the weights after k steps
are one process's.

Checkpoints hold the full model and the optimiser state in one process's own format
(assembled on rank 0): they load without this strategy, and a checkpoint of any plugin
resumes under it. Refused before launch: a plan that cannot be cut exactly (e.g. a
``"heads"`` attention with dropout inside torch's kernel), a model with nothing to cut, a
gradient scaler (its skip-on-inf decision would be per rank), ``sync_batchnorm``, and an
allreduce algorithm whose ranks could sum in different orders.

This class is :class:`~lightning_par.strategies._base.ParStrategy` with a
:class:`~lightning_par.components.tensor_split.TensorParallelSplit` as its splitter.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from typing_extensions import override

from lightning_par.components.tensor_split import (
    EXACT_ALGORITHMS,
    TensorParallelSplit,
    check_same_batch,
    check_trainer,
)
from lightning_par.strategies._base import ParStrategy
from lightning_par.strategies._split_context import StrategyContext


class TensorParallelStrategy(ParStrategy):
    """Megatron-style tensor parallelism over all the devices.

    Args:
        plan: module name (as in ``module.named_modules()``) -> ``"column"``, ``"row"``,
            ``"column_gather"`` or ``"lstm"``; ``None``: the automatic plan of
            ``module.<module_attr>`` (see :mod:`lightning_par.tensorparallel.plan`).
        module_attr: the attribute the automatic plan searches.
        algorithm: the allreduce of ``f`` and ``g``, ``"ring"`` or ``"tree"``.
        **kwargs: ``trace``, ``trace_dir``, ``start_method``, ``process_group_backend``,
            ``timeout``: see :class:`~lightning_par.strategies._base.ParStrategy`.
    """

    strategy_name = "tensor_parallel"
    shards_data = False

    def __init__(
        self,
        plan: Mapping[str, str] | None = None,
        module_attr: str | None = None,
        algorithm: str = "ring",
        **kwargs: Any,
    ) -> None:
        split = TensorParallelSplit(plan, module_attr, algorithm)
        super().__init__(**kwargs)
        self.splitter = split
        split.bind(StrategyContext(self))

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._model_span("tp forward"):
            return super().training_step(*args, **kwargs)

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any):
        with self._model_span("tp backward"):
            return super().backward(closure_loss, optimizer, *args, **kwargs)

    @contextmanager
    def _model_span(self, name: str) -> Iterator[None]:
        """The forward (loss included) and backward of each training step as trace events:
        the what-if simulator weighs the model's own compute apart from the step's overhead
        (:mod:`lightning_par.simulate.profile`). Their collectives stay on the main lane."""
        with self.trace.span(name) if self.trace is not None else nullcontext():
            yield


__all__ = [
    "EXACT_ALGORITHMS",
    "TensorParallelStrategy",
    "check_same_batch",
    "check_trainer",
]
