"""torch's gloo collective tests, written anew for every algorithm of
:data:`lightning_par.collectives.ALGORITHMS` (after ``pytorch/pytorch``,
``test/distributed/test_c10d_gloo.py``: allreduce of rank-valued inputs whose sum is known in
closed form, a stress test of 1000 allreduces issued back to back, fp16 inputs).

Unlike ``tests/test_collectives.py``, which compares with ``dist.all_reduce``, the oracle
here is arithmetic: rank ``r`` holds ``(r + 1) * w`` with ``w[i] = i % 5 + 1``, so every
element's sum is ``p (p + 1) / 2 * w[i]``, exact in every dtype at these magnitudes; sizes
0, 1, p, odd and large (2^20 + 3 elements, many ring segments). Our collectives block (no
async handles), so torch's "1000 works in flight" becomes 1000 calls with no barrier between
them, each with its own values, checked only at the end: a message of call k taken by call
k + 1 (a rank running ahead) shows as a wrong sum. Half-precision sums of random inputs must
be within the worst-case bound of floating-point summation, ``gamma_{p-1} * sum |x_r|`` with
``gamma_n = n u / (1 - n u)`` (Higham, *Accuracy and Stability of Numerical Algorithms*,
2nd ed., 2002, sec. 4.2, for any order of the additions), ``u`` the unit roundoff.
"""

from __future__ import annotations

import pytest
import torch

from lightning_par.collectives import ALGORITHMS
from lightning_par.comm import run_on_ranks

SIZES = (0, 1, 3, 4, 1001, 2**20 + 3)
CALLS = 1000
#: unit roundoff (half the machine epsilon) of each dtype
UNIT = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


def weights(numel: int) -> torch.Tensor:
    return (torch.arange(numel) % 5 + 1).double()


def _rank_valued(rank: int, world: int) -> list[tuple]:
    wrong = []
    for name, allreduce in ALGORITHMS.items():
        for numel in SIZES:
            for dtype in (torch.float32, torch.float16, torch.bfloat16):
                if numel > 5000 and dtype != torch.float32:
                    continue  # (the large size once: it tests segmentation, not rounding)
                got = allreduce(((rank + 1) * weights(numel)).to(dtype))
                expected = world * (world + 1) / 2 * weights(numel)
                if got.dtype != dtype or not torch.equal(got.double(), expected):
                    wrong.append((name, numel, str(dtype), "rank-valued sum"))
        results = [allreduce(torch.full((3,), float(rank * CALLS + k))) for k in range(CALLS)]
        for k, got in enumerate(results):  # sum over r of (r * CALLS + k)
            if not torch.equal(got, torch.full((3,), float(CALLS * world * (world - 1) // 2
                                                           + world * k))):  # fmt: skip
                wrong.append((name, k, "float32", f"call {k} of {CALLS} back to back"))
                break
        for dtype, u in UNIT.items():
            g = torch.Generator().manual_seed(1000 * rank + 17)
            x = (torch.rand(4099, generator=g) * 2 - 1).to(dtype)
            mine = x.double()
            total = mine.clone()
            magnitude = mine.abs()
            for peer in range(world):  # every rank's input, known to all from the seeds
                if peer != rank:
                    theirs = (torch.rand(4099, generator=torch.Generator().manual_seed(
                        1000 * peer + 17)) * 2 - 1).to(dtype).double()  # fmt: skip
                    total += theirs
                    magnitude += theirs.abs()
            n = world - 1
            bound = n * u / (1 - n * u) * magnitude
            err = (allreduce(x.clone()).double() - total).abs()
            if bool((err > bound).any()):
                worst = float((err - bound).max())
                wrong.append((name, 4099, str(dtype), f"beyond gamma_(p-1) bound by {worst:.2e}"))
    return wrong


@pytest.mark.parametrize("world", [3, 4])
def test_every_algorithm_sums_rank_values_exactly_and_within_the_rounding_bound(world):
    for rank, wrong in enumerate(run_on_ranks(_rank_valued, world, timeout=120)):
        assert wrong == [], f"rank {rank}: {wrong}"
