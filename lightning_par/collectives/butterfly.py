"""Butterfly allreduce (recursive doubling): ``log2 p`` exchanges of the whole tensor.

In round ``k`` every rank swaps its partial sum with the rank whose number differs in bit
``k`` and adds what it gets. The talk's example (002): four nodes 1, 2, 3, 4; after the
first round pairs hold 3 and 7, after the second everyone holds 10. No separate
broadcast is needed, so it has the fewest steps of all (course slides 003; Thakur et
al., "Optimization of collective communication operations in MPICH", 2005), at the price
of sending the whole tensor ``log2 p`` times.

Non-powers of two are folded: with ``q`` the largest power of two ``<= p``, the extra
ranks ``q .. p-1`` first hand their tensor to rank ``rank - q`` (step 0), the ``q`` ranks
run the butterfly, and the result goes back to the extra ranks in a last step.

Both partners of a round compute ``a + b`` from the same two operands, and float addition
is commutative, so every rank ends with bit-identical results.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_par.collectives._common import (
    finish,
    ordered_exchange,
    prepare,
    scratch,
)
from lightning_par.comm import CommTrace, Communicator, wait_all


def butterfly_shape(world_size: int) -> tuple[int, int, int]:
    """``(q, extra, rounds)``: power-of-two core size, folded ranks, butterfly rounds."""
    q = 1 << (world_size.bit_length() - 1)
    return q, world_size - q, q.bit_length() - 1


def butterfly_allreduce(
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    comm: Communicator | None = None,
    trace: CommTrace | None = None,
) -> torch.Tensor:
    """Sum ``tensor`` in place over the ranks of ``group`` by recursive doubling.

    Trace steps: ``0`` fold-in (only if ``p`` is not a power of two), then one step per
    round, then the fold-out step.
    """
    comm, flat = prepare(tensor, group, comm, trace)
    if flat is None:
        return tensor
    p, rank = comm.world_size, comm.rank
    q, extra, rounds = butterfly_shape(p)
    first = 1 if extra else 0
    if rank >= q:  # folded rank: hand over, wait for the answer
        comm.send(flat, rank - q, step=0, tag="fold-in")
        comm.recv(flat, rank - q, step=first + rounds, tag="fold-out")
        return finish(tensor, flat)
    # Reused between calls: a fresh buffer costs a page fault per 4 KiB on first touch;
    # receiving 64 MB into a fresh one took ~18 ms more than into a reused one (2-core box).
    incoming = scratch(tuple(flat.shape), flat.dtype, flat.device)
    if rank < extra:
        comm.recv(incoming, rank + q, step=0, tag="fold-in")
        flat.add_(incoming)
    for k in range(rounds):
        partner = rank ^ (1 << k)
        kw = {"step": first + k, "tag": "butterfly"}
        wait_all(ordered_exchange(comm, [(flat, kw)], [(incoming, kw)], partner))
        flat.add_(incoming)
    if rank < extra:
        comm.send(flat, rank + q, step=first + rounds, tag="fold-out")
    return finish(tensor, flat)
