"""The ring allreduce's two phases as collectives of their own: reduce-scatter, all-gather.

Sharded data parallelism (Rajbhandari et al., "ZeRO: memory optimizations toward training
trillion parameter models", 2020) splits the allreduce of the gradients in two: each rank
reduce-scatters the gradients, updates the shard of the weights it owns with its chunk of
the sum, and all-gathers the updated weights. The ring's phases are exactly these
(Patarasuk & Yuan, 2009; course slides 003, pp. 46-49), and each moves half the allreduce's
bytes: ``(p - 1) / p * n`` elements per rank, in ``p - 1`` steps.

Both run on the pipelined ring's engine (:class:`~.ring.SegmentRing`, the same segments,
receive slots and NCCL pairing at ``p = 2``) and trace every message with the ring's tags,
``"reduce-scatter"`` and ``"all-gather"``. The tensor is cut into ``p`` chunks as every
ring cuts it (:func:`~._common.chunk_sizes`: sizes differ by at most one), and rank ``r``
owns chunk ``r``, as in torch's ``reduce_scatter_tensor(out, tensor.view(p, -1))`` and
``all_gather_into_tensor`` when ``p`` divides the size. :func:`~.ring.ring_allreduce`
runs the two as one stream, its reduce-scatter leaving rank ``r`` with chunk
``(r + 1) % p`` instead (:func:`~.ring.ring_steps`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_par.collectives._common import chunk_sizes, flat_work
from lightning_par.collectives.ring import (
    ALL_GATHER,
    DEFAULT_SEGMENT_BYTES,
    RECEIVES_IN_FLIGHT,
    REDUCE_SCATTER,
    run_ring,
)
from lightning_par.comm import CommTrace, Communicator
from lightning_par.split import offsets as split_offsets


def ring_reduce_scatter(
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    comm: Communicator | None = None,
    trace: CommTrace | None = None,
    segment_bytes: int | None = DEFAULT_SEGMENT_BYTES,
    receives_in_flight: int = RECEIVES_IN_FLIGHT,
) -> torch.Tensor:
    """Sum chunk ``r`` of ``tensor`` over the ranks into rank ``r``'s, in place.

    Afterwards chunk ``r`` of rank ``r``'s ``tensor`` holds the sum over the ranks of their
    chunk ``r``; its other chunks hold partial sums (scratch). With one rank, or no
    elements, ``tensor`` is left as it is.

    Args:
        tensor: any shape and floating dtype; CPU or CUDA. Cut into chunks in its flat
            (row-major) order.
        group, comm, trace, segment_bytes, receives_in_flight: as for
            :func:`~.ring.ring_allreduce`.

    Returns:
        This rank's chunk, 1-D: a view of ``tensor`` when it is contiguous. A
        non-contiguous ``tensor`` is summed in a contiguous copy that is then written back
        to it; its chunk is not a strided view of it, so the chunk returned is the copy's
        (the same values, not shared with ``tensor``).
    """
    comm, flat = run_ring(tensor, (REDUCE_SCATTER,), group, comm, trace, segment_bytes,
                          receives_in_flight, "ring_reduce_scatter")  # fmt: skip
    if flat is None:
        flat = flat_work(tensor)
    sizes = chunk_sizes(flat.numel(), comm.world_size)
    start = split_offsets(sizes)[comm.rank]
    return flat[start : start + sizes[comm.rank]]


def ring_all_gather(
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    comm: Communicator | None = None,
    trace: CommTrace | None = None,
    segment_bytes: int | None = DEFAULT_SEGMENT_BYTES,
    receives_in_flight: int = RECEIVES_IN_FLIGHT,
) -> torch.Tensor:
    """Give every rank every rank's own chunk of ``tensor``, in place.

    Before, chunk ``r`` of rank ``r``'s ``tensor`` holds rank ``r``'s data (the rest is
    ignored and overwritten); afterwards every chunk of every rank's ``tensor`` holds its
    owner's data. Chunks and arguments as for :func:`ring_reduce_scatter`; each chunk is
    received straight into its place. Returns ``tensor``.
    """
    run_ring(tensor, (ALL_GATHER,), group, comm, trace, segment_bytes, receives_in_flight,
             "ring_all_gather")  # fmt: skip
    return tensor
