"""GPipe pipeline parallelism as a Lightning strategy: one process per stage.

The network ``module.<module_attr>`` (an ``nn.Sequential``) is cut into ``K = devices``
stages; each process keeps one stage and the batch is fed through as ``chunks``
micro-batches (Huang et al., 2019). The algorithm lives in :mod:`lightning_par.pipeline`;
this file only plugs it into Lightning's hooks.

Contract with the LightningModule (the models in :mod:`lightning_par.models` satisfy it):

* ``module.net`` (``module_attr``) is an ``nn.Sequential`` whose elements each map one
  tensor to one tensor, best with no batch-coupled layers (BatchNorm normalises each
  micro-batch on its own: a warning says so; use GroupNorm);
* the loss depends on the parameters only through ``self.net(x)``, called once per step
  with the whole batch; everything after it (loss, metrics, logging) runs unchanged on
  every rank with the real output, which the last stage sends to all stages;
* for the schedules past GPipe (``"1f1b"``, ``"interleaved"``, ``"zero_bubble"``) the loss
  per micro-batch is ``loss_fn(output, target)`` (the strategy's ``loss_fn``, e.g.
  ``nn.CrossEntropyLoss()``, else ``module.criterion``, ``loss_attr``), a *mean* over the
  samples (a mean loss is the size-weighted sum of micro-batch losses), and the target is
  ``batch[target_index]`` (default 1: ``(x, y, ...)``), as torch's pipelining schedules take
  ``loss_fn`` and the target apart (:mod:`lightning_par.components.pipeline_loss`); the loss
  Lightning logs is still the one ``training_step`` computes on the joined output;
* inputs of the network that carry the batch (an LSTM's ``hidden``, batch in dimension 1)
  are cut into micro-batches along their own batch dimension, and outputs joined alike;
  tuples/lists of tensors travel between stages as their tensors
  (:mod:`lightning_par.pipeline.batch_dims`, :mod:`lightning_par.graphcut.nested`).

All stages read the same batches (no distributed sampler; checked once, on the first
batch). Checkpoints hold the full model gathered on rank 0, which loads without this
strategy (``CifarCNN.load_from_checkpoint``), and the whole model's optimiser state in the
format of the user's optimiser in one process (:mod:`lightning_par.pipeline.optim_state`),
so they resume under any strategy. Clipping by norm, ``16-mixed`` and BatchNorm: see
:mod:`lightning_par.components.pipeline_features`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning_par.components.pipeline_options import PipelineOptions
from lightning_par.components.pipeline_split import PipelineSplit
from lightning_par.strategies._base import ParStrategy
from lightning_par.strategies._split_context import StrategyContext


class GPipeStrategy(ParStrategy):
    """Pipeline parallelism with micro-batches and re-materialisation (GPipe).

    Args:
        balance: layers per stage (``len(balance)`` = number of devices); ``None`` balances
            automatically (``balance_by``).
        chunks: micro-batches per batch, ``M``; ``1`` is the naive layer-per-device split.
        checkpoint: re-materialisation, ``"never"``, ``"except_last"`` or ``"always"``;
            ``None``: ``"except_last"``, but ``"never"`` under ``"zero_bubble"`` (its B/W
            split keeps the activations for W).
        schedule: ``"gpipe"`` (all forwards, then all backwards), ``"1f1b"``,
            ``"interleaved"`` (interleaved 1F1B, ``virtual_stages`` stages per device) or
            ``"zero_bubble"`` (ZB-H1: backward split into input- and weight-gradient steps);
            see :mod:`lightning_par.pipeline.schedules`.
        virtual_stages: stages per device under ``"interleaved"`` (``v``; ``balance`` then
            has ``devices * v`` entries and ``chunks`` must be a multiple of ``devices``).
        module_attr: the LightningModule's attribute holding the network (``None``: ``net``,
            or its only child module with parameters).
        split_points: module names to cut before, ``devices * stages_per_device - 1`` of them
            (``["layer3"]``: torch's ``SplitPoint.BEGINNING``), for any network; ``None``:
            an ``nn.Sequential`` is cut by ``balance``, any other network at points chosen
            by ``balance_by``.
        loss_attr: name of the LightningModule's mean-reduced loss module, used by the
            schedules past ``"gpipe"`` when ``loss_fn`` is not given.
        loss_fn: the mean-reduced loss ``(output, target) -> loss`` those schedules call per
            micro-batch (e.g. ``nn.CrossEntropyLoss()``; ``output`` as the network returns
            it); ``None``: ``module.<loss_attr>``. Precedence: ``loss_fn``, then the attribute.
        target_index: where the target is in the batch, ``batch[target_index]`` (``1`` for
            ``(x, y)``, ``2`` for ``(index, x, y)``, a key for a dict batch).
        balance_by: automatic balance by ``"params"`` (parameter count) or ``"time"``
            (forward + backward time per layer on ``module.example_input_array``).
        deferred_batch_norm: BatchNorm layers keep their running statistics over the whole
            mini-batch (torchgpipe's; :mod:`lightning_par.pipeline.batchnorm`); each
            micro-batch is still normalised with its own statistics.
        **kwargs: ``trace``, ``trace_dir`` (per-rank traces for
            :mod:`lightning_par.pipeline.timeline`), ``start_method``,
            ``process_group_backend``, ``timeout``: see
            :class:`~lightning_par.strategies._base.ParStrategy`.
    """

    strategy_name = "gpipe"
    shards_data = False

    def __init__(
        self,
        balance: list[int] | None = None,
        chunks: int = 4,
        checkpoint: str | None = None,
        schedule: str = "gpipe",
        module_attr: str | None = None,
        loss_attr: str = "criterion",
        balance_by: str = "params",
        deferred_batch_norm: bool = False,
        virtual_stages: int = 2,
        split_points: list[str] | None = None,
        loss_fn: Callable | None = None,
        target_index: int | str = 1,
        **kwargs: Any,
    ) -> None:
        # every argument above is a pipeline option, checked (and the schedule looked up) here
        split = PipelineSplit(PipelineOptions.of(locals()))
        super().__init__(**kwargs)
        self.splitter = split
        split.bind(StrategyContext(self))
