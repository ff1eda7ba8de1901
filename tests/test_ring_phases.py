"""The ring's two phases alone (collectives/ring_phases.py) against torch's own collectives.

``ring_reduce_scatter`` is compared with ``reduce_scatter_tensor`` (``reduce_scatter_single``
in recent torch) and ``ring_all_gather`` with ``all_gather_into_tensor``
(``all_gather_single``), gloo's own, whenever ``p`` divides the size. Those need equal
chunks, so for the other sizes the references are an ``all_reduce`` sliced to this rank's
chunk and an ``all_gather`` of chunks padded to equal length, cut back. Their composition is
an allreduce; their traces match their cost models exactly. The order of their steps and
messages, and their volume, are checked in ``test_collective_schedules.py``.

One launch per world size runs the whole grid (a launch costs ~1 s on the CI machine).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lightning_par.collectives import ring_all_gather, ring_allreduce, ring_reduce_scatter
from lightning_par.collectives._common import chunk_sizes
from lightning_par.collectives.cost_model import all_gather_cost, reduce_scatter_cost
from lightning_par.collectives.ring import (
    ALL_GATHER,
    REDUCE_SCATTER,
    ring_steps,
)
from lightning_par.comm import CommTrace, run_on_ranks
from lightning_par.split import offsets as split_offsets

DTYPES = (torch.float32, torch.float64, torch.bfloat16)
TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 5e-2}
#: Small segments, so that a few thousand elements pipeline through several messages.
SEGMENT_BYTES = 1024
# torch 2.10 renamed them (the old names still work, with a warning)
torch_reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
torch_all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)


def sizes_for(p: int) -> list[int]:
    """Fewer elements than ranks, ``p`` itself, sizes ``p`` does not divide, and multiples of
    ``p`` of several segments a chunk (5004 = 12 * 417)."""
    return sorted({0, 1, max(p - 1, 1), p, 2 * p + 1, 97, 12 * p, 5003, 5004})


def _chunk(flat: torch.Tensor, p: int, rank: int) -> torch.Tensor:
    sizes = chunk_sizes(flat.numel(), p)
    start = split_offsets(sizes)[rank]
    return flat[start : start + sizes[rank]]


def _torch_reduce_scatter(x: torch.Tensor, p: int, rank: int) -> torch.Tensor:
    if x.numel() % p == 0:
        out = x.new_empty(x.numel() // p)
        torch_reduce_scatter(out, x.clone())
        return out
    full = x.clone()
    dist.all_reduce(full)
    return _chunk(full, p, rank)


def _torch_all_gather(mine: torch.Tensor, numel: int, p: int) -> torch.Tensor:
    if numel % p == 0:
        out = mine.new_empty(numel)
        torch_all_gather(out, mine)
        return out
    sizes = chunk_sizes(numel, p)
    padded = torch.cat([mine, mine.new_zeros(max(sizes) - mine.numel())])
    pieces = [torch.empty_like(padded) for _ in range(p)]
    dist.all_gather(pieces, padded)
    return torch.cat([piece[:size] for piece, size in zip(pieces, sizes)])


def _traffic_problems(trace: CommTrace, phase: str, numel: int, dtype, p: int) -> list[str]:
    """The trace against the cost model, and every message's tag, step and chunk."""
    rank, size = trace.rank, torch.empty(0, dtype=dtype).element_size()
    model = {REDUCE_SCATTER: reduce_scatter_cost, ALL_GATHER: all_gather_cost}[phase]
    cost = model(numel, p, size, segment_bytes=SEGMENT_BYTES)
    problems = []
    if (trace.bytes_sent, trace.messages_sent) != (cost.bytes_sent[rank], cost.messages_sent[rank]):
        problems.append("traffic differs from the cost model")
    steps = ring_steps(rank, p, (phase,))
    for m in trace.messages:
        expected = steps[m.step][1 if m.op == "send" else 2] if m.step < p - 1 else None
        if m.tag != phase or m.chunk != expected:
            problems.append(f"message {m.op} step {m.step} chunk {m.chunk} tagged {m.tag!r}")
            break  # the first is enough
    return problems


def _grid(rank: int, p: int) -> list[tuple]:
    problems = []
    for numel in sizes_for(p):
        for dtype in DTYPES:
            g = torch.Generator().manual_seed(7919 * rank + numel)
            # Small integers sum exactly in every dtype: those results must be bit-identical.
            exact = torch.randint(-8, 9, (numel,), generator=g).to(dtype)
            noisy = torch.randn(numel, generator=g).to(dtype)
            for kind, x in (("exact", exact), ("noisy", noisy)):
                where = (numel, str(dtype), kind)
                for problem in _check_one(x, p, rank, kind == "exact"):
                    problems.append((*where, problem))
    return problems


def _check_one(x: torch.Tensor, p: int, rank: int, exact: bool) -> list[str]:
    tol = TOLERANCE[x.dtype]

    def same(got: torch.Tensor, want: torch.Tensor) -> bool:
        if exact:
            return torch.equal(got, want)
        return torch.allclose(got.double(), want.double(), rtol=tol, atol=tol)

    problems = []
    # reduce-scatter: this rank's chunk of the sum, a view of the tensor
    trace, work = CommTrace(rank), x.clone()
    got = ring_reduce_scatter(work, trace=trace, segment_bytes=SEGMENT_BYTES)
    if not same(got, _torch_reduce_scatter(x, p, rank)):
        problems.append("reduce-scatter differs from torch's")
    if got.numel() and got.data_ptr() != _chunk(work, p, rank).data_ptr():
        problems.append("reduce-scatter's chunk is not a view of the tensor")
    problems += _traffic_problems(trace, REDUCE_SCATTER, x.numel(), x.dtype, p)

    # all-gather: only this rank's chunk is filled in; NaN elsewhere must all be overwritten
    trace, work = CommTrace(rank), torch.full_like(x, float("nan"))
    _chunk(work, p, rank).copy_(_chunk(x, p, rank))
    if ring_all_gather(work, trace=trace, segment_bytes=SEGMENT_BYTES) is not work:
        problems.append("all-gather does not return its tensor")
    if not torch.equal(work, _torch_all_gather(_chunk(x, p, rank).clone(), x.numel(), p)):
        problems.append("all-gather differs from torch's")
    problems += _traffic_problems(trace, ALL_GATHER, x.numel(), x.dtype, p)

    # the two in turn: an allreduce
    work, summed = x.clone(), x.clone()
    ring_reduce_scatter(work, segment_bytes=SEGMENT_BYTES)
    ring_all_gather(work, segment_bytes=SEGMENT_BYTES)
    dist.all_reduce(summed)
    if not same(work, summed):
        problems.append("all-gather after reduce-scatter differs from torch's all_reduce")
    if p == 2 and not torch.equal(work, ring_allreduce(x.clone(), segment_bytes=SEGMENT_BYTES)):
        problems.append("the two phases are not bit-equal to ring_allreduce at p = 2")
    agreed = work.clone()
    dist.broadcast(agreed, src=0)
    if not torch.equal(agreed, work):
        problems.append("ranks disagree after the two phases")
    return problems


@pytest.mark.parametrize("p", [2, 3, 4])
def test_phases_equal_torchs_collectives_and_their_cost_models(p):
    """Each phase equals torch's own (or the reference above), on every size and dtype,
    and sends exactly what its cost model says, each message tagged with its phase.

    The two in turn equal torch's ``all_reduce``, and at ``p = 2`` are bit-equal to
    ``ring_allreduce``: each chunk's sum is then one addition ``a + b``, which gives the same
    bits in either order. At ``p >= 3`` a sum of three or more numbers depends on where it
    starts (floating-point addition is not associative): the fused ring starts chunk ``c``
    at rank ``c``, the phases alone at rank ``c + 1`` (so that it ends at rank ``c``, its
    owner), so the two agree only to rounding.
    """
    for rank, problems in enumerate(run_on_ranks(_grid, p, timeout=120)):
        assert problems == [], f"rank {rank} of {p}, {len(problems)} problems: {problems[:6]}"


def _views(rank: int, p: int) -> list[str]:
    problems = []
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6) * (rank + 1)
    total = base / (rank + 1) * sum(range(1, p + 1))
    t = base.clone()
    view = t.t()  # not contiguous: chunked in its own (row-major) order
    chunk = ring_reduce_scatter(view)
    mine = _chunk(total.t().reshape(-1), p, rank)
    if not torch.equal(chunk, mine) or not torch.equal(_chunk(view.reshape(-1), p, rank), mine):
        problems.append("reduce-scatter of a transposed view")
    ring_all_gather(view)
    if not torch.equal(view, total.t()) or not torch.equal(t, total):
        problems.append("all-gather of a transposed view")
    scalar = torch.tensor(float(rank + 1))
    first = ring_reduce_scatter(scalar)  # one element: chunk 0 holds it, the others are empty
    if first.shape != ((1,) if rank == 0 else (0,)) or (
        rank == 0 and first.item() != p * (p + 1) / 2
    ):
        problems.append("reduce-scatter of a 0-d tensor")
    if ring_all_gather(scalar).item() != p * (p + 1) / 2:
        problems.append("all-gather of a 0-d tensor")
    return problems


def test_non_contiguous_and_0_d_tensors():
    assert run_on_ranks(_views, 3) == [[], [], []]


def test_a_bool_tensor_gets_the_allreduces_error_naming_the_phase():
    messages = {}
    for fn in (ring_allreduce, ring_reduce_scatter, ring_all_gather):
        with pytest.raises(TypeError, match="bool") as refused:
            fn(torch.ones(3, dtype=torch.bool))
        messages[fn.__name__] = str(refused.value)
    for name in ("ring_reduce_scatter", "ring_all_gather"):
        assert messages[name] == messages["ring_allreduce"].replace("allreduce", name, 1)
        assert messages[name].startswith(name) and "convert it" in messages[name]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_cuda_tensors(backend):
    if backend == "nccl" and torch.cuda.device_count() < 2:
        pytest.skip("NCCL needs one GPU per rank")
    assert run_on_ranks(_phases_on_gpu, 2, backend=backend) == [[], []]


def _phases_on_gpu(rank: int, p: int) -> list[str]:
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    x = torch.arange(1001, dtype=torch.float32, device=device) * (rank + 1)
    work = x.clone()
    chunk = ring_reduce_scatter(work, segment_bytes=1024)
    mine = _chunk(x.cpu() * 3 / (rank + 1), p, rank)
    problems = [] if torch.equal(chunk.cpu(), mine) else ["reduce-scatter"]
    ring_all_gather(work, segment_bytes=1024)
    if work.device != device or not torch.equal(work.cpu(), x.cpu() * 3 / (rank + 1)):
        problems.append("all-gather")
    return problems
