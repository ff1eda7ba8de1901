"""The model-parallel kinds a hybrid grid runs in its rows, and the options each takes.

:class:`~lightning_par.strategies.hybrid.HybridStrategy` declares the union of the kinds'
options as its own keyword parameters (:data:`KIND_OPTIONS`), so that the command line and
a YAML config (jsonargparse reads signatures only) can set them; it passes the ones given
to the kind's splitter, which refuses another kind's option by name (:func:`make_splitter`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

from lightning_par.components.pipeline_options import LAYERWISE_OPTIONS, PipelineOptions
from lightning_par.components.pipeline_split import PipelineSplit
from lightning_par.components.splitter import ModelSplitter
from lightning_par.components.tensor_split import TensorParallelSplit
from lightning_par.components.wavefront_split import layerwise_split

DEFAULT_KIND = "gpipe"


class Kind(NamedTuple):
    """A model-parallel kind: the options it takes and its splitter, built from them."""

    options: tuple[str, ...]
    build: Callable[..., ModelSplitter]


def _pipeline(**options: Any) -> PipelineSplit:
    """The pipeline of ``GPipeStrategy``."""
    return PipelineSplit(PipelineOptions(**options))


_TENSOR = tuple(n for n in inspect.signature(TensorParallelSplit).parameters if n != "self")

#: The model-parallel kinds a hybrid row can run.
KINDS: dict[str, Kind] = {
    "gpipe": Kind(PipelineOptions.names(), _pipeline),
    "layerwise": Kind(LAYERWISE_OPTIONS, layerwise_split),
    "tensor_parallel": Kind(_TENSOR, TensorParallelSplit),
}

#: Every option of any kind, as HybridStrategy declares them (None: the kind's default).
KIND_OPTIONS = (
    "balance", "chunks", "checkpoint", "schedule", "module_attr", "loss_attr", "balance_by",
    "deferred_batch_norm", "time_chunk", "virtual_stages", "split_points", "plan", "algorithm",
    "loss_fn", "target_index",
)  # fmt: skip


def mp_kinds() -> list[str]:
    """The model-parallel kinds a hybrid grid can run in its rows."""
    return list(KINDS)


def kind_option_names(kind: str) -> list[str]:
    """The options the splitter of ``kind`` takes."""
    return list(KINDS[kind].options)


def make_splitter(kind: object, options: dict[str, Any]) -> ModelSplitter:
    """The splitter of ``kind`` built from its own ``options`` (a clear error for others)."""
    if kind not in KINDS:
        raise ValueError(f"hybrid: mp_kind={kind!r}: choose one of {mp_kinds()}")
    known = kind_option_names(kind)  # type: ignore[arg-type]
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise TypeError(
            f"HybridStrategy got unknown option(s) {unknown} for mp_kind={kind!r}; it accepts "
            f"dp, mp, mp_kind, dp_algorithm, bucket_cap_mb, overlap, {', '.join(known)} and "
            "trace, trace_dir, start_method, process_group_backend, timeout, dead_peer_timeout"
        )
    return KINDS[kind].build(**options)  # type: ignore[index]
