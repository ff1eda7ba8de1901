"""Every allreduce collective equals torch.distributed.all_reduce, for world sizes 1..8,
sizes 0, 1, < p, not divisible by p, and float32/float16/bfloat16; traces match the cost model.

One fork per world size runs the whole grid (a launch costs ~1 s on the CI machine). How
the collectives post their messages is checked in ``test_collective_schedules.py``.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist

from lightning_par.collectives import ALGORITHMS, get_allreduce, ring_allreduce, tree_broadcast
from lightning_par.collectives.cost_model import predict
from lightning_par.comm import CommTrace, run_on_ranks

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-2, torch.bfloat16: 5e-2}


def sizes_for(world_size: int) -> list[int]:
    """0, 1, below p, p, not divisible by p, and a few thousand (several ring segments)."""
    p = world_size
    return sorted({0, 1, max(p - 1, 1), p, 2 * p + 1, 97, 5003})


# Small segments so that even a few thousand elements pipeline through many messages.
OPTIONS = {"ring": {"segment_bytes": 1024}}


def _grid(rank: int, world_size: int) -> list[tuple]:
    """Run every algorithm on every size and dtype; return mismatches and trace totals."""
    problems, totals = [], []
    for numel in sizes_for(world_size):
        for dtype in DTYPES:
            g = torch.Generator().manual_seed(7919 * rank + numel)
            # Small integers sum exactly in every dtype: results must be bit-identical.
            exact = torch.randint(-8, 9, (numel,), generator=g).to(dtype)
            noisy = torch.randn(numel, generator=g).to(dtype)
            expected_exact, expected_noisy = exact.clone(), noisy.clone()
            dist.all_reduce(expected_exact)
            dist.all_reduce(expected_noisy)
            for name, allreduce in ALGORITHMS.items():
                trace = CommTrace(rank)
                got = allreduce(exact.clone(), trace=trace, **OPTIONS.get(name, {}))
                if not torch.equal(got, expected_exact):
                    problems.append((name, numel, str(dtype), "exact sum differs"))
                got = allreduce(noisy.clone(), **OPTIONS.get(name, {}))
                tol = TOLERANCE[dtype]
                if not torch.allclose(got.float(), expected_noisy.float(), rtol=tol, atol=tol):
                    problems.append((name, numel, str(dtype), "float sum differs"))
                # Every rank must hold the same bits (else replicas drift apart in training).
                agreed = got.clone()
                dist.broadcast(agreed, src=0)
                if not torch.equal(agreed, got):
                    problems.append((name, numel, str(dtype), "ranks disagree"))
                totals.append((name, numel, exact.element_size(), trace.totals()))
    return [problems, totals]


@pytest.mark.parametrize("world_size", range(1, 9))
def test_collectives_equal_torch_all_reduce(world_size):
    results = run_on_ranks(_grid, world_size, timeout=60)
    for rank, (problems, totals) in enumerate(results):
        assert problems == [], f"rank {rank} of {world_size}: {problems}"
        assert len(totals) == len(sizes_for(world_size)) * len(DTYPES) * len(ALGORITHMS)
        for name, numel, element_size, measured in totals:
            model = predict(name, numel, world_size, element_size, **OPTIONS.get(name, {}))
            assert measured["bytes_sent"] == model.bytes_sent[rank], (name, numel, rank)
            assert measured["messages_sent"] == model.messages_sent[rank], (name, numel, rank)


def _shapes_and_views(rank: int, world_size: int) -> list[str]:
    problems = []
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6) * (rank + 1)
    for name, allreduce in ALGORITHMS.items():
        # A non-contiguous view is reduced in place too (through a contiguous copy).
        t = base.clone()
        view = t.t()
        allreduce(view)
        expected = base.t() * sum(range(1, world_size + 1)) / (rank + 1)
        if not torch.equal(view, expected) or not torch.equal(t, expected.t()):
            problems.append(f"{name}: transposed view")
        scalar = torch.tensor(float(rank))
        allreduce(scalar)
        if scalar.item() != sum(range(world_size)):
            problems.append(f"{name}: 0-d tensor")
    root_value = torch.full((5,), float(rank))
    tree_broadcast(root_value, root=world_size - 1)
    if not torch.equal(root_value, torch.full((5,), float(world_size - 1))):
        problems.append("tree_broadcast from the last rank")
    return problems


def test_shapes_views_and_broadcast():
    assert run_on_ranks(_shapes_and_views, 3) == [[], [], []]


def _large(rank: int, world_size: int, numel: int) -> list[str]:
    x = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
    expected = x.clone()
    dist.all_reduce(expected)
    problems = []
    for name in ("ring", "tree", "butterfly"):
        got = get_allreduce(name)(x.clone())
        if not torch.allclose(got, expected, rtol=1e-5, atol=1e-5):
            problems.append(name)
    return problems


def test_tens_of_millions_of_elements():
    # 10M + 19 floats on 3 ranks: uneven chunks, 13 pipeline segments per ring chunk.
    assert run_on_ranks(_large, 3, 10_000_019, timeout=120) == [[], [], []]


def test_bad_input_errors():
    with pytest.raises(ValueError, match="unknown allreduce algorithm 'rnig'"):
        get_allreduce("rnig")
    with pytest.raises(ValueError, match="segment_bytes must be > 0"):
        predict("ring", 10, 2, segment_bytes=0)

    assert run_on_ranks(_bool_tensor_refused, 2) == [True, True]


# Rank functions live at module level: where fork is unsafe (a GPU machine after a backward
# pass) run_on_ranks starts them through a forkserver, which pickles them.
def _bool_tensor_refused(rank, world_size):
    with pytest.raises(TypeError, match="bool"):
        ring_allreduce(torch.ones(3, dtype=torch.bool))
    return True


def _dead_peer(rank: int, world_size: int):
    if rank == 1:
        raise SystemExit(3)  # dies without taking part
    ring_allreduce(torch.ones(10))


def test_dead_rank_ends_the_collective_with_a_clear_error():
    from lightning_par.comm import RankFailed

    with pytest.raises(RankFailed, match="rank 1 of 3"):
        run_on_ranks(_dead_peer, 3, timeout=10)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_cuda_tensors(backend):
    if backend == "nccl" and torch.cuda.device_count() < 2:
        pytest.skip("NCCL needs one GPU per rank")

    assert run_on_ranks(_every_algorithm_on_gpu, 2, backend=backend) == [[], []]


def _every_algorithm_on_gpu(rank, world_size):
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    x = torch.arange(1000, dtype=torch.float32, device=device) * (rank + 1)
    problems = []
    for name, allreduce in ALGORITHMS.items():
        got = allreduce(x.clone())
        if got.device != device or not torch.equal(got.cpu(), x.cpu() * 3 / (rank + 1)):
            problems.append(name)
    return problems


def test_scratch_rows_are_cut_again_from_a_regrown_buffer():
    # scratch_rows keeps its row views per shape while the thread's scratch buffer is the
    # one they were cut from; a larger request replaces that buffer, and the next call must
    # cut new rows from it, not hand back views into the buffer left behind
    from lightning_par.collectives._common import scratch, scratch_rows

    def storage(t: torch.Tensor) -> int:
        return t.untyped_storage().data_ptr()

    def check() -> None:  # in a new thread: its scratch buffers start empty
        cpu, f32 = torch.device("cpu"), torch.float32
        first = scratch_rows(2, 4, f32, cpu)
        assert scratch_rows(2, 4, f32, cpu) is first  # the same buffer: views made once
        wide = scratch_rows(3, 10, f32, cpu)  # 30 elements after 8: the buffer regrows
        assert [r.shape for r in wide] == [(10,)] * 3
        assert wide[0].untyped_storage().nbytes() == 30 * 4
        again = scratch_rows(2, 4, f32, cpu)
        assert again is not first and storage(again[0]) == storage(wide[0]) != storage(first[0])
        again[0].fill_(1.0)
        again[1].fill_(2.0)
        first[0].fill_(7.0)  # an old view writes to the old buffer, not into the new rows
        assert scratch((8,), f32, cpu).tolist() == [1.0] * 4 + [2.0] * 4

    with ThreadPoolExecutor(1) as pool:
        pool.submit(check).result()


def test_every_algorithm_is_described_and_registered_as_a_strategy():
    from lightning_par.collectives import ALGORITHMS, DESCRIPTIONS
    from lightning_par.strategies import plugin_names

    assert set(DESCRIPTIONS) == set(ALGORITHMS)
    assert {f"{name}_allreduce" for name in ALGORITHMS} <= set(plugin_names())


def _shared_communicator(rank: int, world_size: int) -> list[bool]:
    from lightning_par.collectives._common import resolve_communicator

    first = resolve_communicator(None, None, None)
    trace = CommTrace(rank)
    traced = resolve_communicator(None, None, trace)
    subgroup = dist.new_group([0, 1])
    on_subgroup = resolve_communicator(subgroup, None, None)
    x = ring_allreduce(torch.full((10,), float(rank)))
    return [
        resolve_communicator(None, None, None) is first,  # untraced default calls share one
        traced is not first and traced.trace is trace,  # a traced call records its messages
        on_subgroup is not first and on_subgroup.group is subgroup,
        bool((x == sum(range(world_size))).all()),
    ]


def test_untraced_calls_on_the_default_group_share_one_communicator():
    for checks in run_on_ranks(_shared_communicator, 2):
        assert checks == [True, True, True, True]
