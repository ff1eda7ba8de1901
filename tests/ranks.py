"""``run_on_ranks`` with one intra-op thread per forked rank, for the allreduce tests.

A forked child hangs in its first OpenMP parallel region if the parent (this pytest
process) already started an OpenMP pool, which any earlier test may have done; and the
CI machine's 2 cores are shared by the ranks anyway (Lightning's launchers do the same).
"""

from __future__ import annotations

import torch

from lightning_par.comm import run_on_ranks


def run_ranks(fn, world_size: int, *args, **kwargs):
    def one_thread(rank, size, *a, **kw):
        torch.set_num_threads(1)
        return fn(rank, size, *a, **kw)

    return run_on_ranks(one_thread, world_size, *args, **kwargs)
