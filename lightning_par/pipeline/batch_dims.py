"""Which dimension of each input and output tensor is the batch's, for micro-batching.

GPipe splits the mini-batch into micro-batches and joins their outputs (Huang et al., 2019,
section 2.2; :mod:`.microbatch`). A network's inputs need not all hold the batch in
dimension 0: Lightning's demo ``SimpleLSTM`` takes ``hidden``, shaped ``(layers, batch,
hidden)`` (torch's ``nn.LSTM`` documents ``h_0`` as ``(D * num_layers, N, H_out)``), and
returns its new ``hidden`` shaped alike. The rules here:

* an **input** tensor's batch dimension is dimension 0 if its size is the batch size ``n``
  (the first input's dimension 0), else the first dimension of size ``n``; a tensor with no
  such dimension (a mask, a table) is given whole to every micro-batch
  (:func:`input_dims`, decided once, on the first batch the network is cut for);
* an **output** tensor's batch dimension is the one whose size differs between the network
  traced on one micro-batch and on the whole batch (:func:`output_dims`); dimension 0 when
  none does (an output flattened to ``(batch * seq, vocab)`` is joined along 0).

A tensor whose batch dimension is ambiguous (an input with another dimension of size ``n``
before it, e.g. ``layers == n``) is cut along the first: give a batch size that differs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lightning_par.pipeline.microbatch import micro_batch_sizes

Dims = tuple[int | None, ...]


def batch_dim(t: torch.Tensor, n: int) -> int | None:
    """``t``'s batch dimension for a batch of ``n`` (see the module docstring)."""
    if t.dim() and t.shape[0] == n:
        return 0
    return next((d for d, size in enumerate(t.shape) if size == n), None)


def input_dims(leaves: Sequence[torch.Tensor]) -> Dims:
    """The batch dimension of each input tensor; the first input's is 0 by definition."""
    n = leaves[0].shape[0]
    return (0,) + tuple(batch_dim(t, n) for t in leaves[1:])


def check_inputs(leaves: Sequence[torch.Tensor], dims: Dims) -> None:
    """Each input's batch dimension has the first input's size (else it was cut for other
    inputs: a clear error, not micro-batches of mismatched samples)."""
    n = leaves[0].shape[0]
    for j, (t, d) in enumerate(zip(leaves, dims)):
        if d is not None and (t.dim() <= d or t.shape[d] != n):
            raise ValueError(
                f"input tensor {j} of shape {tuple(t.shape)} has no batch of {n} in dimension "
                f"{d}, where the batch was when the network was cut: every call must give "
                "the network inputs laid out alike"
            )


def scatter_inputs(leaves: Sequence[torch.Tensor], dims: Dims, chunks: int) -> list[tuple]:
    """The inputs of each of ``chunks`` micro-batches: each tensor split along its batch
    dimension (:func:`~.microbatch.micro_batch_sizes`), or whole where it has none."""
    sizes = micro_batch_sizes(leaves[0].shape[0], chunks)
    parts = [
        torch.split(t, sizes, dim=d) if d is not None else [t] * chunks
        for t, d in zip(leaves, dims)
    ]
    return list(zip(*parts))


def first_samples(leaves: Sequence[torch.Tensor], dims: Dims, size: int) -> tuple:
    """The inputs of the first ``size`` samples (a micro-batch to trace the network on)."""
    return tuple(t if d is None else t.narrow(d, 0, size) for t, d in zip(leaves, dims))


def output_dims(micro: Sequence[torch.Tensor], whole: Sequence[torch.Tensor] | None) -> Dims:
    """Each output's batch dimension: where its shape on one micro-batch (``micro``) and on
    the whole batch (``whole``) differ; 0 where none does or ``whole`` is unknown."""
    if whole is None or len(whole) != len(micro):
        return (0,) * len(micro)
    found = []
    for m, w in zip(micro, whole):
        differ = [d for d, (a, b) in enumerate(zip(m.shape, w.shape)) if a != b]
        found.append(differ[0] if differ and m.dim() == w.dim() else 0)
    return tuple(found)


def gather_outputs(per_micro: Sequence[Sequence[torch.Tensor]], dims: Dims) -> list[torch.Tensor]:
    """Each output tensor of the micro-batches joined along its batch dimension."""
    return [torch.cat([outs[j] for outs in per_micro], dim=d or 0) for j, d in enumerate(dims)]


def split_output_grad(grad: torch.Tensor, dim: int | None, sizes: Sequence[int]) -> list:
    """The gradient of a joined output, cut back into the micro-batches' (``sizes`` along
    the output's batch dimension)."""
    return list(grad.split(list(sizes), dim=dim or 0))
