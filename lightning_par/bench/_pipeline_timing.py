"""What each process of the pipeline benchmark measures: the one-process reference, and on
every pipeline device each contender's step (wall clock and CPU), its trace, its messages
and the activations it saves for backward.

The contenders run in rounds that interleave them, so that load from other processes hits
all alike; each keeps its best round (on a shared machine other processes only ever add
time).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from lightning_par.bench._peers import PeerGuard
from lightning_par.bench._pipeline_contenders import (
    OURS,
    TORCH_SCHEDULES,
    WORKLOADS,
    balances,
    ours,
    runs,
    theirs,
)
from lightning_par.bench.malloc import keep_freed_memory
from lightning_par.pipeline import CHECKPOINT_MODES
from lightning_par.pipeline.schedules import GPIPE


def time_steps(step: Callable[[], object], optimizer: torch.optim.Optimizer, warmup: int,
               steps: int, rounds: int = 1,
               group: dist.ProcessGroup | None = None) -> tuple[float, float]:  # fmt: skip
    """Seconds per training step, wall clock and this thread's CPU time: the best of ``rounds``
    rounds of ``steps`` steps (the best, because on a shared machine other processes only
    ever add time). CPU time barely moves with load from elsewhere, so it shows what a change
    costs or saves when the wall clock cannot (it leaves out gloo's own threads). The ranks
    meet at barriers of ``group`` (a peer's own, so that a peer failing leaves ours alone)."""

    def one_step():
        optimizer.zero_grad()
        step()
        optimizer.step()

    for _ in range(warmup):
        one_step()
    best, best_cpu = float("inf"), float("inf")
    for _ in range(rounds):
        if dist.is_initialized():
            dist.barrier(group=group)
        start, cpu = time.perf_counter(), time.thread_time()
        for _ in range(steps):
            one_step()
        cpu = time.thread_time() - cpu
        if dist.is_initialized():
            dist.barrier(group=group)
        best = min(best, (time.perf_counter() - start) / steps)
        best_cpu = min(best_cpu, cpu / steps)
    return best, best_cpu


def single(rank: int, world_size: int, workload: str, threads: int, warmup: int, steps: int,
           rounds: int, keep_memory: bool = False) -> float:  # fmt: skip
    """Seconds per step of one process training the whole model with ``threads`` threads."""
    if keep_memory:
        keep_freed_memory()
    torch.set_num_threads(threads)
    net, x, y, loss_fn = WORKLOADS[workload]()
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    return time_steps(lambda: loss_fn(net(x), y).backward(), opt, warmup, steps, rounds)[0]


def _contenders(same: tuple, chunks: list[int], world_size: int, peers: tuple[str, ...],
                guard: PeerGuard) -> list[tuple]:  # fmt: skip
    """``(name, M, (device, optimizer, step), group)`` of each contender: ours (``device``
    set, our group), then each of torch's ``peers`` that could be built (``device`` None,
    the peer's own group; one that failed is in ``guard.failed``)."""
    contenders = [("naive", 1, ours(GPIPE, 1, *same), None)]
    contenders += [(s.name, m, ours(s, m, *same), None) for s in OURS for m in chunks
                   if runs(s, m, world_size)]  # fmt: skip
    for kind in peers:
        name, group = f"torch {kind}", guard.group(f"torch {kind}")
        for m in chunks:
            built = guard.run(name, lambda k=kind, m=m, g=group: theirs(k, m, *same, group=g))
            if built is not None:
                contenders.append((name, m, built, group))
    return contenders


def pipelines(rank: int, world_size: int, workload: str, chunks: list[int], warmup: int,
              steps: int, rounds: int, virtual: int = 2, keep_memory: bool = False,
              peers: tuple[str, ...] = TORCH_SCHEDULES, *, guard: PeerGuard) -> dict:  # fmt: skip
    """This device's measurements of every contender (run on each of ``world_size`` ranks,
    by :func:`~lightning_par.bench._peers.run_with_peers`); a peer of torch's that fails is
    left out of ``runs`` (its failure: ``guard.failed``)."""
    if keep_memory:  # every contender of this process alike, ours and torch's
        keep_freed_memory()
    torch.set_num_threads(1)
    base, x, y, loss_fn = WORKLOADS[workload]()
    cuts = balances(workload, base, x, world_size, virtual, chunks, rank)
    results: dict = {"balance": cuts["pipeline"][max(chunks)], "balances": cuts,
                     "runs": [], "saved_bytes": {}}  # fmt: skip
    same = (base, cuts, rank, world_size, virtual, x, y, loss_fn)
    contenders = _contenders(same, chunks, world_size, peers, guard)
    # rounds interleave the contenders, so that load from other processes hits all alike
    best = [float("inf")] * len(contenders)
    cpu = [float("inf")] * len(contenders)
    for _ in range(rounds):
        for i, (name, _, (device, opt, step), group) in enumerate(contenders):
            if device is not None:
                device.comm.trace.clear()  # keep the last round's steps for the bubble
                wall, thread = time_steps(step, opt, warmup, steps)
            else:
                timed = guard.run(
                    name, lambda s=step, o=opt, g=group: time_steps(s, o, warmup, steps, group=g)
                )
                if timed is None:
                    continue
                wall, thread = timed
            best[i], cpu[i] = min(best[i], wall), min(cpu[i], thread)
    kept = [(c, b, u) for c, b, u in zip(contenders, best, cpu) if c[0] not in guard.failed]
    for (name, m, (device, _, _), _), seconds, cpu_s in kept:
        run = {"name": name, "chunks": m, "step_s": seconds, "cpu_s": cpu_s}
        if device is not None:
            first = device.step_index - steps
            sent = [msg for msg in device.comm.trace.sent() if msg.step >= first]
            run.update(trace=device.comm.trace, first_step=first,
                       messages_per_step=len(sent) / steps,
                       bytes_per_step=sum(msg.nbytes for msg in sent) / steps)  # fmt: skip
        results["runs"].append(run)
    for run, ((_, _, (device, _, step), _), _, _) in zip(results["runs"], kept):
        if device is not None:  # one more step, counting the activations saved for backward
            device.measure_memory()
            step()
            run["peak_saved_bytes"] = device.saved.peak

    for mode in CHECKPOINT_MODES:
        device, opt, step = ours(GPIPE, max(chunks), *same, checkpoint=mode)
        device.measure_memory()
        step()
        results["saved_bytes"][mode] = device.saved.nbytes
    return results
