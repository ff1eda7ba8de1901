"""What a rank's training step costs in CPU at each size on this machine: the model's step
timed on each size's batch, a core to each rank, and what taking turns on the cores adds.

**The batch a rank reads.** A data-parallel rank at ``p`` reads ``global_batch / p``
images, and its step's CPU does not follow that in proportion: the framework's work per step
(the loop, logging, the optimiser) stays, and the model's own time is not linear in the
batch where activations outgrow a core's cache (CifarCNN's training step, one thread: 15.5,
19.1 and 29.5 ms at 12, 16 and 24 images). So the scale-out keeps the framework's part of
the base run's CPU per step and scales its per-sample part by the model's step on ``p``'s
batch over on the base batch, both timed here (``alone``; a ratio, so a machine that slows
both alike moves it little: :func:`.scale.on_this_machine`).

**Taking turns.** Processor sharing (:mod:`.cores`) stretches a rank's step by the time it
waits for a core, its CPU time unchanged. On a real CPU the ranks that take turns on a core
also evict each other's data from its caches (here 1 MB of L2 per core, about one CIFAR
activation of 16 images), and the scheduler moves ranks between cores when they cannot be
placed evenly, so each comes back to cold caches: the same step costs more CPU. Here 3
processes on the 2 cores took 21.5-22.5 ms for the 16-image step (+14 %), 4 processes
15.4-16.4 ms for the 12-image one (+3 %); the validation's 3-worker ranks ran 7-20 % above
the 2-worker runs' CPU scaled to 16 images, its 4-worker ranks 0-7 % (``cost``).

:func:`measure_step_cpu` times both: ``cores`` ranks (a core each) run the step on every
size's batch, then, for each size whose ranks outnumber the cores, that many ranks run it
on their batch, the ranks meeting after each step as data-parallel ranks do; medians of
the steps, of the ranks and of the trials. One trial's cost reads anywhere from 0.9 to 1.4
on this machine, so each trial runs 60 steps and three quiet trials are kept. A trial beside
other processes' load (:mod:`.other_load`) is run again; without a quiet trial neither is
measured, and the scale-out scales the per-sample work by the batch and pays no cost.
"""

from __future__ import annotations

import statistics
import time
from typing import NamedTuple

import torch
import torch.distributed as dist

from lightning_par.launch import run_on_ranks
from lightning_par.measure.probe import machine_busy_s
from lightning_par.measure.run import make_model, sample_shape
from lightning_par.simulate.other_load import QUIET_LOAD, loop_other_load


def _train_steps(rank: int, world: int, model_name: str, batches: list[int], steps: int,
                 threads: int) -> dict:  # fmt: skip
    """``steps`` training steps of ``model_name`` on each of ``batches`` random images, the
    ranks meeting after each (as data-parallel ranks do: a rank that waits sleeps, and its
    core goes to another): per batch, the median CPU seconds per step of this thread
    (``step_cpu``); and what :func:`.other_load.loop_other_load` reads."""
    torch.set_num_threads(threads)
    token = torch.zeros(1)
    torch.manual_seed(rank)
    model = make_model(model_name)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    wall, cpu, busy = time.perf_counter(), time.process_time(), machine_busy_s()
    out = []
    for batch in batches:
        images = torch.randn(batch, *sample_shape(model))
        labels = torch.randint(0, 10, (batch,))
        seconds = []
        dist.all_reduce(token)  # start together
        for _ in range(steps):
            start = time.thread_time()
            loss = torch.nn.functional.cross_entropy(model(images), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            seconds.append(time.thread_time() - start)
            dist.all_reduce(token)
        out.append(statistics.median(seconds[2:] or seconds))
    after = machine_busy_s()
    return {"step_cpu": out, "cpu": time.process_time() - cpu,
            "wall": time.perf_counter() - wall,
            "busy": after - busy if rank == 0 and after is not None and busy is not None
            else None}  # fmt: skip


def _median(ranks: list[dict], key: str, i: int) -> float:
    return statistics.median(r[key][i] for r in ranks)


def _trial(model_name: str, global_batch: int, sizes: tuple[int, ...], cores: int,
           threads: int, steps: int, timeout: float) -> tuple[float, dict, dict]:  # fmt: skip
    """One trial: the other load beside it; each size's step alone, and its cost with turns."""
    batches = [max(global_batch // p, 1) for p in sizes]
    each = max(cores // threads, 1)
    alone = run_on_ranks(_train_steps, each, model_name, batches, steps, threads,
                         timeout=timeout)  # fmt: skip
    other = loop_other_load(alone)
    timed = {p: _median(alone, "step_cpu", i) for i, p in enumerate(sizes)}
    turns = {}
    for p, batch in zip(sizes, batches):
        if p * threads > cores:
            crowded = run_on_ranks(_train_steps, p, model_name, [batch], steps, threads,
                                   timeout=timeout)  # fmt: skip
            other = max(other, loop_other_load(crowded))
            turns[p] = _median(crowded, "step_cpu", 0) / timed[p]
    return other, timed, turns


class Steps(NamedTuple):
    """What :func:`measure_step_cpu` read: per size, the model's step a core each
    (``alone``, CPU seconds) and the cost of taking turns (``cost``); empty where no trial
    was quiet."""

    alone: dict[int, float]
    cost: dict[int, float]


def measure_step_cpu(model_name: str, global_batch: int, sizes: tuple[int, ...], cores: int,
                     threads: int = 1, steps: int = 60, trials: int = 3,
                     timeout: float = 120) -> Steps:  # fmt: skip
    """Per size in ``sizes``: the CPU seconds of ``model_name``'s training step on the batch
    a rank of that size reads, a core each (``alone``); per size whose ranks (``threads``
    each) outnumber ``cores``, how many times that its step takes when they take turns on
    the cores (``cost``, at least 1). Medians over ``trials`` quiet trials (a trial beside
    other load is run again, ``trials`` more times at most). See the module docstring."""
    quiet = []
    for _ in range(2 * trials):
        found = _trial(model_name, global_batch, sizes, cores, threads, steps, timeout)
        if found[0] <= QUIET_LOAD:
            quiet.append(found)
        if len(quiet) == trials:
            break
    if not quiet:
        return Steps({}, {})
    alone = {p: statistics.median(t[1][p] for t in quiet) for p in sizes}
    cost = {p: max(statistics.median(t[2][p] for t in quiet), 1.0) for p in quiet[0][2]}
    return Steps(alone, cost)
