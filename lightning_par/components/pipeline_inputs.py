"""The network's inputs as the pipeline sees them: one call of the network as the user's code
makes it (:func:`capture_inputs`), one micro-batch to trace, the batch dimension of each
input and output tensor, and a first batch to look at before launch.

Used by :mod:`lightning_par.components.graph_pipeline` (and ``capture_inputs`` by the
tensor-parallel split). The rules for batch dimensions are
:mod:`lightning_par.pipeline.batch_dims`'s; containers of tensors (an LSTM's ``hidden``)
are flattened as :mod:`lightning_par.graphcut.nested` does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import fx, nn

from lightning_par import _compat
from lightning_par.graphcut import nested, trace
from lightning_par.pipeline import batch_dims as bd

#: the LightningModule's own data loader hook for each trainer function
_LOADER_HOOKS = {
    TrainerFn.FITTING: "train_dataloader",
    TrainerFn.VALIDATING: "val_dataloader",
    TrainerFn.TESTING: "test_dataloader",
    TrainerFn.PREDICTING: "predict_dataloader",
}


def input_leaves(args: Sequence[Any]) -> list[Any]:
    """The tensors of the arguments that travel (tensors, tuples/lists of tensors)."""
    return [t for a in args if nested.travels(a) for t in nested.flatten(a)[0]]


def micro_example(args: tuple, micro: int) -> tuple[tuple, bd.Dims]:
    """``args`` cut to their first ``micro`` samples, each tensor along its batch dimension
    (``hidden`` of an LSTM along dimension 1), and the batch dimension of each tensor."""
    leaves = input_leaves(args)
    if not leaves or leaves[0].dim() == 0:
        return args, ()
    dims = bd.input_dims(leaves)
    it = iter(bd.first_samples(leaves, dims, min(micro, leaves[0].shape[0])))
    example = []
    for a in args:
        if not nested.travels(a):
            example.append(a)
            continue
        structure = nested.structure_of(a)
        example.append(nested.unflatten([next(it) for _ in range(nested.count(structure))],
                                        structure))  # fmt: skip
    return tuple(example), dims


def output_tensors(traced: fx.GraphModule) -> list[Any] | None:
    """The example tensors of a traced network's output (``None`` if it is not a
    tuple/list of tensors)."""
    node = next(n for n in traced.graph.nodes if n.op == "output")
    value = fx.node.map_aggregate(
        node.args[0], lambda v: v.meta.get("example") if isinstance(v, fx.Node) else v
    )
    return nested.flatten(value)[0] if nested.travels(value) else None


def output_dims(
    net: nn.Module, args: tuple, traced_micro: fx.GraphModule, leaf: Sequence[str]
) -> bd.Dims | None:
    """Each output tensor's batch dimension: traced once more on the whole batch ``args``,
    where its shape differs from the micro-batch's (:func:`~.batch_dims.output_dims`)."""
    micro = output_tensors(traced_micro)
    if micro is None:
        return None
    try:
        whole = output_tensors(trace(net, args, leaf))
    except Exception:  # noqa: BLE001  (then joined along 0, as before)
        whole = None
    return bd.output_dims(micro, whole)


def own_first_batch(module: pl.LightningModule, trainer: Any) -> Callable[[], Any] | None:
    """Where the main process can look at a first batch before any rank starts: the
    LightningModule's own data loader hook for the trainer's function, when it defines one
    and no ``prepare_data`` (data it downloads would not be there yet); else ``None``."""
    fn = getattr(getattr(trainer, "state", None), "fn", None)
    hook = _LOADER_HOOKS.get(fn)  # type: ignore[arg-type]
    if hook is None or not is_overridden(hook, module, pl.LightningModule):
        return None
    if is_overridden("prepare_data", module, pl.LightningModule):
        return None

    def first() -> Any:
        loaders = getattr(module, hook)()
        if isinstance(loaders, (list, tuple)):
            loaders = loaders[0]
        if isinstance(loaders, dict):
            loaders = next(iter(loaders.values()))
        return next(iter(loaders))

    return first


class _Captured(Exception):
    """Raised by the recording forward once it has the network's inputs."""


def capture_inputs(
    module: pl.LightningModule,
    net: nn.Module,
    trainer: pl.Trainer | None,
    who: str,
    first_batch: Callable[[], Any] | None = None,
) -> tuple[tuple, dict]:
    """``(args, kwargs)`` of one call of ``net`` as the user's code makes it (on
    ``first_batch()`` when given, else on the trainer's first batch)."""
    seen: dict[str, Any] = {}

    def record(*args: Any, **kwargs: Any) -> None:
        seen["call"] = (args, kwargs)
        raise _Captured

    # a network split by an earlier run has its pipeline as the instance's forward: put it back
    own = net.__dict__.get("forward")
    net.forward = record  # type: ignore[method-assign]
    sample = getattr(module, "example_input_array", None)
    # the look must not draw random numbers the training would have drawn (a shuffling data
    # loader seeds its sampler from torch's generator): dropout masks stay one process's
    cuda = [torch.cuda.current_device()] if torch.cuda.is_initialized() else []  # (no init)
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=cuda):
            if sample is not None:
                if isinstance(sample, dict):
                    module(**sample)
                else:
                    module(*(sample if isinstance(sample, tuple) else (sample,)))
            elif trainer is not None:
                fn = trainer.state.fn
                # as the step will see it: floating tensors in the precision's dtype
                raw = first_batch() if first_batch is not None else _compat.first_batch(trainer)
                batch = trainer.precision_plugin.convert_input(raw)
                step = {
                    TrainerFn.VALIDATING: module.validation_step,
                    TrainerFn.TESTING: module.test_step,
                    TrainerFn.PREDICTING: module.predict_step,
                }.get(fn, module.training_step)
                step(batch, 0)
    except _Captured:
        pass
    except Exception as error:  # the step failed before calling the network
        raise ValueError(
            f"{who} runs the network once to learn its inputs and could not ({error}): set "
            "`self.example_input_array` in your LightningModule (a small batch of the inputs "
            "forward() takes)"
        ) from error
    finally:
        if own is None:
            net.__dict__.pop("forward", None)
        else:
            net.forward = own  # type: ignore[method-assign]
    if "call" not in seen:
        raise ValueError(
            f"{who}: the network was never called by forward or the step; set "
            "`self.example_input_array`"
        )
    return seen["call"]
