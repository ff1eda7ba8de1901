"""Scale out: each strategy's step at ``p`` devices, its graph (:mod:`.builders`: from the
plugin's own schedule and cost model, compute taken from the measured run) replayed by
:mod:`.engine`, and its throughput and efficiency (:func:`scaling_row`).

Compute: data-parallel ranks read ``global_batch / p`` samples, so their compute scales by
``world / p``; model-parallel ranks hold ``1/p`` of the model. ``cores`` models a machine
whose ranks share that many CPU cores (this one, in the validation): the engine replays the
graph with processor sharing (:mod:`.cores`), so only ranks that compute *at the same time*
slow each other (a pipeline's idle stages and the servers' waits take no core), a lane that
stands for ``p`` data-parallel ranks counts ``p`` times, and the measured compute is first
divided by the sharing the same model finds in the measured run (its own ``world`` ranks on
``cores``). Ranks that cannot be placed evenly on the cores (3 on 2) are not made to wait
for a core the scheduler leaves idle: the data-parallel training runs of the validation
showed no such wait (:mod:`.cores`). ``None`` gives every device its own processor (the
``--from`` tables).
"""

from __future__ import annotations

from dataclasses import replace

from lightning_par.simulate.builders import NotApplicable, build
from lightning_par.simulate.cores import lightning_threads
from lightning_par.simulate.engine import simulate
from lightning_par.simulate.links import Topology
from lightning_par.simulate.memory import state_bytes_per_rank
from lightning_par.simulate.profile import Profile


def predict_step(prof: Profile, p: int, topo: Topology, speed: float = 1.0,
                 cores: int | None = None, weak: bool = False,
                 threads: int | None = None, other_load: float = 0.0) -> float:  # fmt: skip
    """Predicted step seconds of ``prof``'s strategy at ``p`` devices (workers)."""
    return predict_split(prof, p, topo, speed, cores, weak, threads, other_load)[0]


def predict_split(prof: Profile, p: int, topo: Topology, speed: float = 1.0,
                  cores: int | None = None, weak: bool = False, threads: int | None = None,
                  other_load: float = 0.0, turn_cost: float = 1.0
                  ) -> tuple[float, dict[str, float]]:  # fmt: skip
    """:func:`predict_step` and the per-step split, mean over the worker lanes (a lane that
    stands for ``p`` ranks counts once): ``compute``, ``communication``, ``waiting`` (they
    sum to the step) and, of compute and communication, the seconds spent waiting for a
    core (``core_compute``, ``core_communication``). ``threads``: intra-op threads per
    rank, at every size (``OMP_NUM_THREADS``); default: what Lightning picks for ``p``
    ranks on ``cores``. ``other_load``: cores' worth other processes take
    (:func:`.cores.capacity`). ``turn_cost``: how many times its CPU a rank's step takes
    where ``p`` ranks all compute at once on ``cores`` (:mod:`.sharing_cost`), paid by each
    compute span as far as it shares the cores (:func:`.cores.turn_factor`)."""
    graph = build(prof, p, topo, cores, weak)
    contention = prof.family in ("ps", "async_ps")
    if contention:
        topo = Topology(replace(topo.intra, shared=True), replace(topo.inter, shared=True),
                        topo.per_node)  # fmt: skip
    if cores is not None and not prof.cpu_based:  # wall spans hold the sharing of world ranks
        speed = speed * measured_sharing(prof, topo, cores, threads)
    threads = threads or (lightning_threads(p, cores) if cores else 1)
    turns = (turn_cost, p * threads / cores) if cores is not None and turn_cost > 1 else None
    result = simulate(graph, topo, speed, contention, cores=cores, threads=threads,
                      other_load=other_load, turn_cost=turns)  # fmt: skip
    workers = [w for w in range(p) if w in result.end]
    step = (sum(result.step_s(w) for w in workers) / len(workers) if contention
            else result.max_step_s)  # fmt: skip
    split = {k: sum(result.per_step_split(w)[k] for w in workers) / len(workers)
             for k in ("compute", "communication", "waiting")}  # fmt: skip
    for kind in ("compute", "communication"):
        waited = (result.per_step_core_wait(w)[kind] for w in workers)
        split[f"core_{kind}"] = sum(waited) / len(workers)
    return step, split


def measured_sharing(prof: Profile, topo: Topology, cores: int,
                     threads: int | None = None) -> float:  # fmt: skip
    """How many times its own work the measured run's compute took by the model of
    :mod:`.cores`: its graph at ``world`` ranks on ``cores``, compute with over without."""
    graph = build(prof, prof.world, topo, cores, weak=False)
    threads = threads or lightning_threads(prof.world, cores)
    shared = simulate(graph, topo, cores=cores, threads=threads)
    alone = simulate(graph, topo)
    own = sum(r["compute"] for r in alone.split.values())
    return sum(r["compute"] for r in shared.split.values()) / own if own else 1.0


DATA_PARALLEL = ("allreduce", "ddp", "local_sgd", "ps", "async_ps", "zero")


def on_this_machine(prof: Profile, p: int, step_cpu: dict[int, float]) -> Profile:
    """``prof`` for predicting ``p`` ranks on the machine that timed ``step_cpu``
    (:func:`.sharing_cost.measure_step_cpu`): a data-parallel rank's per-sample work scaled
    by the model's step on ``p``'s batch over on the base batch, not by the batch alone
    (:func:`.step_costs.sample_scale`). ``prof`` itself where they were not timed."""
    world = prof.world
    if prof.family not in DATA_PARALLEL or not prof.cpu_based or p not in step_cpu:
        return prof
    if not step_cpu.get(world):
        return prof
    return replace(prof, sample_scale={**prof.sample_scale, p: step_cpu[p] / step_cpu[world]})


def global_batch(prof: Profile, p: int, weak: bool) -> float:
    """Samples per step at ``p``: data-parallel ranks each add their batch when ``weak``."""
    if not weak:
        return prof.global_batch
    if prof.family in DATA_PARALLEL:
        return prof.global_batch / prof.world * p
    if prof.family == "hybrid":
        mp = int(prof.options.get("mp") or 2)
        return prof.global_batch / max(prof.world // mp, 1) * (p // mp)
    return prof.global_batch  # the model is split, not the batch


def scaling_row(prof: Profile, p: int, topo: Topology, speed: float = 1.0,
                weak: bool = True) -> dict:  # fmt: skip
    """Step time, throughput and efficiency at ``p`` (``None`` with the reason where the
    strategy cannot run there). Efficiency is throughput over ``p`` devices' worth of one
    device's compute-only throughput (``compute_s * world / global_batch`` per sample).
    ``state_bytes``: model state per rank by the formulas of
    :mod:`lightning_par.simulate.memory` (``None``: none for this strategy)."""
    out = {"strategy": prof.strategy, "devices": p, "state_bytes": state_bytes_per_rank(prof, p)}
    try:
        step = predict_step(prof, p, topo, speed, weak=weak)
    except NotApplicable as err:
        return {**out, "step_s": None, "images_per_s": None, "efficiency": None,
                "note": str(err)}  # fmt: skip
    per_sample = prof.compute_s * prof.world / prof.global_batch / speed
    rate = global_batch(prof, p, weak) / step
    return {**out, "step_s": step, "images_per_s": rate, "efficiency": rate * per_sample / p,
            "note": ""}  # fmt: skip
