"""The user's network as the pipeline calls it: the tensors its arguments hold, each with its
own batch dimension, and its output rebuilt in the network's own structure.

Inputs and outputs may be tuples/lists (nested) of tensors (:mod:`lightning_par.graphcut.
nested`), e.g. an LSTM's ``hidden``: they travel as their tensors, each cut into
micro-batches along its own batch dimension (:mod:`.batch_dims`).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from lightning_par.graphcut import GraphSplit, nested
from lightning_par.pipeline import batch_dims as bd


class NetworkIO:
    """The inputs ``split`` was cut for and the structure of ``net``'s output.

    Args:
        net: the user's network; split: its cut.
        input_dims, output_dims: the batch dimension of each input and output tensor
            (:mod:`.batch_dims`); ``None``: inputs found per call, outputs along 0.
    """

    def __init__(self, net: nn.Module, split: GraphSplit, input_dims: bd.Dims | None,
                 output_dims: bd.Dims | None) -> None:  # fmt: skip
        self.signature = inspect.signature(net.forward)
        self.input_names = split.stages[0].inputs
        self.input_structures = split.input_structures or (None,)
        self.output_structure = split.output_structure
        self.input_dims, self.output_dims = input_dims, output_dims

    def leaves(self, args: tuple, kwargs: dict) -> tuple[torch.Tensor, ...]:
        """The input tensors of one call ``net(*args, **kwargs)``; a call the cut was not
        traced for (other arguments, other structures) is refused."""
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        k = len(self.input_structures)
        values = list(bound.arguments.values())[:k]
        extra = [
            n
            for n, v in list(bound.arguments.items())[k:]
            if v is not self.signature.parameters[n].default
        ]
        alike = [nested.travels(v) and nested.structure_of(v) == s
                 for v, s in zip(values, self.input_structures)]  # fmt: skip
        if extra or len(values) < k or not all(alike):
            raise TypeError(
                f"the pipelined network was cut for the inputs ({', '.join(self.input_names)}), "
                f"all tensors; it was called with {', '.join(bound.arguments)}"
            )
        return tuple(t for v in values for t in nested.flatten(v)[0])

    def structured(self, leaves: tuple[torch.Tensor, ...]) -> tuple:
        """The network's arguments holding the input tensors ``leaves`` (the inverse of
        :meth:`leaves`)."""
        it, args = iter(leaves), []
        for structure in self.input_structures:
            args.append(nested.unflatten([next(it) for _ in range(nested.count(structure))],
                                         structure))  # fmt: skip
        return tuple(args)

    def rebuilt(self, leaves: list[torch.Tensor]) -> Any:
        """The network's output holding the output tensors ``leaves``."""
        if self.output_structure is None:
            return leaves[0]
        return nested.unflatten(leaves, self.output_structure)

    def in_dims(self, xs: tuple[torch.Tensor, ...]) -> bd.Dims:
        """The batch dimension of each input tensor (given, or found), checked."""
        dims = self.input_dims if self.input_dims is not None else bd.input_dims(xs)
        bd.check_inputs(xs, dims)
        return dims

    def out_dims(self, count: int) -> bd.Dims:
        """The batch dimension of each of ``count`` output tensors."""
        return self.output_dims if self.output_dims is not None else (0,) * count


def shape_key(xs: tuple[torch.Tensor, ...], dims: bd.Dims, size: int) -> tuple:
    """The shapes (without the batch dimension) and dtypes of inputs, and the micro-batch
    size: one traced cut serves every batch with this key."""
    shapes = tuple(
        (tuple(s for i, s in enumerate(t.shape) if i != d), t.dtype) for t, d in zip(xs, dims)
    )
    return shapes + (size,)


def split_target(target: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """The target of each micro-batch, cut along its batch dimension (:mod:`.batch_dims`)."""
    n = sum(sizes)
    d = bd.batch_dim(target, n) if isinstance(target, torch.Tensor) else None
    if d is None:
        raise ValueError(
            f"the target ({nested.describe(target)} of shape "
            f"{tuple(getattr(target, 'shape', ()))}) has no dimension of the batch size {n}: "
            "the loss per micro-batch needs a target tensor holding one row per sample"
        )
    return list(target.split(sizes, dim=d))
