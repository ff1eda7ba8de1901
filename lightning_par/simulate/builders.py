"""Each strategy's step graph at ``p`` devices, from its :class:`~.profile.Profile` (what
:mod:`.scale` replays).

The graph at ``p`` comes from the plugin's own schedule and cost model; only compute is taken
from the measured run:

* **allreduce family** (and ``lightning_ddp``, ``local_sgd``): forward, then backward in
  ``B`` slices, each filling one bucket that a background lane allreduces as soon as it is
  full (overlap, as :mod:`lightning_par.comm.buckets` does); each bucket costs
  :func:`lightning_par.collectives.cost_model.predict` (ring ``2(p-1)`` steps, tree ``2D``,
  butterfly ``log2 p``, ...) on the slowest link the ``p`` ranks span. Local SGD averages the
  parameters once every ``period`` steps, after the step.
* **parameter servers**: ``p`` worker lanes and ``S`` server lanes with explicit push and
  pull messages, the servers' ports shared (contention): ``S`` links carry ``p`` workers'
  traffic. A step runs from the pushes to the end of the next backward: the servers'
  turn overlaps the worker's work between steps (optimiser, next batch: the part of its
  compute that is not forward and backward), then the forward waits for the pulls.
  ``async_sgd`` has no barrier: a server answers each push on its own.
* **gpipe / layerwise**: ``K = p`` stage lanes running
  :func:`lightning_par.pipeline.schedule.gpipe_steps` for ``M`` micro-batches (layerwise: 1),
  activations and gradients as messages between neighbours; each stage computes its share
  of the measured model under the strategy's own cut at ``p`` (:mod:`.stage_share`), and
  on shared cores each stage is placed whole on one (:func:`.cores.place`).
* **tensor_parallel**: the busiest rank computes its slice of every layer the automatic plan
  cuts at ``p`` and every other layer whole (:mod:`.tp_share`); the step's overhead outside
  forward and backward is not split; the plan's allreduces at ``p``, each a ring allreduce.
  A user's own run (no compare model to plan) assumes every layer split evenly.

* Where the ranks share this machine's cores (``cores``), each pays its measured
  communication CPU (:func:`communication_cpu`) as work that shares them too.
* **hybrid**: its ``mp`` stays as measured, ``dp = p / mp`` replicas ring-allreduce ``1/mp``
  of the gradients.
* **zero**: the measured units (buckets) on one communication lane, each ring phase
  ``(p-1)(alpha + beta S)`` for a unit of ``p S`` bytes. Stage 1: the allreduce family's
  buckets, then an all-gather of every unit after the step; stage 2: a reduce-scatter per
  unit behind backward, then the all-gathers; stage 3: forward and backward in one slice
  per unit (backward twice the forward), each waiting for its unit's all-gather, the next
  one prefetched while it computes, a reduce-scatter after each backward slice.
"""

from __future__ import annotations

from lightning_par.collectives.cost_model import predict
from lightning_par.pipeline.schedule import gpipe_steps
from lightning_par.simulate.links import Topology
from lightning_par.simulate.ops import (
    After,
    Comm,
    Compute,
    Graph,
    Join,
    Msg,
    NotApplicable,
    Post,
    Wait,
)
from lightning_par.simulate.profile import Profile
from lightning_par.simulate.stage_share import stages_at
from lightning_par.simulate.tp_share import busiest_share, mean_over_busiest, tp_allreduces
from lightning_par.tensorparallel.cost import all_gather_cost

__all__ = ["BUILDERS", "NotApplicable", "build", "busiest_share"]


def _allreduce_s(algorithm: str, nbytes: int, p: int, topo: Topology) -> float:
    link = topo.slowest(p)
    return predict(algorithm, max(nbytes // 4, 1), p).time(link.alpha, link.beta)


def sample_scale(prof: Profile, p: int) -> float:
    """A data-parallel rank's per-sample work at ``p`` over at the measured size: its batch,
    ``world / p`` of the measured, or, where the model's step was timed on both batches on
    this machine (:attr:`~.profile.Profile.sample_scale`), that step's ratio."""
    return prof.sample_scale.get(p, prof.world / p)


def batch_share(prof: Profile, p: int, weak: bool) -> float:
    """Data-parallel compute at ``p`` over the measured: the per-sample part
    (:attr:`~.profile.Profile.batch_s`) scales by :func:`sample_scale` at a fixed global
    batch (strong scaling), by 1 at a fixed batch per device (weak scaling); the per-step
    part stays."""
    if weak or not prof.compute_s:
        return 1.0
    fixed = prof.compute_s - prof.batch_s
    return (fixed + prof.batch_s * sample_scale(prof, p)) / prof.compute_s


def data_parallel_graph(prof: Profile, p: int, topo: Topology, cores: int | None,
                        weak: bool = False) -> Graph:  # fmt: skip
    work = prof.compute_s * batch_share(prof, p, weak)
    bwd = min(prof.backward_s, prof.batch_s) * (1.0 if weak else sample_scale(prof, p))
    g = Graph(weight={0: p})
    main = g.lane(0)
    if prof.family == "local_sgd":
        period = int(prof.options.get("period") or 1)
        main.append(Compute(work))
        main.append(Comm(_allreduce_s(prof.algorithm, prof.grad_bytes, p, topo) / period,
                         "average / period"))  # fmt: skip
        return g
    buckets = prof.buckets if bwd > 0 else 1
    # the step's per-step part (loop, hooks, logging) pays no cost of taking turns: that
    # cost was timed on the model's own step (:mod:`.sharing_cost`)
    fixed = min(max(prof.compute_s - prof.batch_s, 0.0), work - bwd) if cores else 0.0
    if fixed > 0:
        main.append(Compute(fixed, "overhead", turns=False))
    main.append(Compute(work - bwd - fixed, "forward"))
    bg = g.lane(0, "bg")
    each = _allreduce_s(prof.algorithm, prof.grad_bytes // buckets, p, topo)
    cpu = communication_cpu(prof, cores) / buckets
    for _ in range(buckets):
        if bwd > 0:
            main.append(Compute(bwd / buckets, "backward"))
        bg.extend([After((0, "main"), len(main) - 1, 1.0), Comm(each, "allreduce bucket")])
        if cpu:
            bg.append(Comm(cpu, "communication CPU", on_cores=True))
    main.append(Join((0, "bg"), len(bg)))
    return g


def communication_cpu(prof: Profile, cores: int | None) -> float:
    """CPU seconds per step a rank spends moving its messages beyond its main thread (gloo's
    threads, the bucket thread: :attr:`~.profile.Profile.comm_cpu_s`, measured), where the
    ranks share ``cores`` of this machine (``None``: other hardware, where the link's cost
    says it all). Measured on 2 to 4 ranks of the allreduce family it barely follows the
    bytes a rank sends (a ring at 4 ranks sends 1.5 times the bytes of 2, and spent 1.85
    against 2.05 ms), so it is carried as measured."""
    return prof.comm_cpu_s if cores is not None else 0.0


def ps_graph(prof: Profile, p: int, topo: Topology, cores: int | None,
             weak: bool = False) -> Graph:  # fmt: skip
    s_count = prof.servers or 1
    scale = batch_share(prof, p, weak)
    g = Graph()
    share = prof.grad_bytes // s_count
    push = [[g.message(Msg(w, p + s, share)) for s in range(s_count)] for w in range(p)]
    pull = [[g.message(Msg(p + s, w, share)) for s in range(s_count)] for w in range(p)]
    # one step from the pushes on: the server's turn overlaps the worker's loop between
    # steps (optimiser, next batch); the next forward waits for the pulls
    between = max(prof.compute_s - prof.batch_s, 0.0)
    for w in range(p):
        lane = g.lane(w)
        lane.extend([*map(Post, push[w]), *map(Post, pull[w]), *map(Wait, push[w])])
        lane.extend([Compute(between, "between steps", turns=False), *map(Wait, pull[w])])
        lane.append(Compute(prof.compute_s * scale - between))
    serve = Compute(prof.server_s, "update")
    for s in range(s_count):
        lane = g.lane(p + s)
        pushes, pulls = [push[w][s] for w in range(p)], [pull[w][s] for w in range(p)]
        if prof.family == "ps":  # synchronous: every push, one update, every pull
            lane.extend([*map(Post, pushes), *map(Wait, pushes), serve, *map(Post, pulls)])
            lane.extend(map(Wait, pulls))
        else:
            for one_push, one_pull in zip(pushes, pulls):
                lane.extend([Post(one_push), Wait(one_push), serve, Post(one_pull), Wait(one_pull)])
    return g


def pipeline_graph(prof: Profile, p: int, topo: Topology, cores: int | None,
                   weak: bool = False) -> Graph:  # fmt: skip
    if prof.max_devices and p > prof.max_devices:
        raise NotApplicable(f"{p} stages > {prof.limit}")
    chunks = 1 if prof.family == "layerwise" else prof.chunks
    fwd, bwd = prof.fwd_s, prof.bwd_s  # per micro-batch, the whole model
    rest = max(prof.compute_s - chunks * (prof.fwd_s + prof.bwd_s) / prof.world, 0.0)
    if not fwd and not bwd:  # no fwd/bwd spans: all compute, backward twice the forward
        whole = prof.compute_s * prof.world / chunks
        fwd, bwd, rest = whole / 3, 2 * whole / 3, 0.0
    shares, cuts = stages_at(prof, p, chunks, cores is not None)
    # a stage's messages cost it CPU where ranks share this machine's cores: the measured
    # stage's (one neighbour) per message it sends
    per_send = communication_cpu(prof, cores) / chunks
    g = Graph(placed=True)
    act = {(s, i): g.message(Msg(s, s + 1, cuts[s])) for s in range(p - 1)
           for i in range(chunks)}  # fmt: skip
    grad = {(s, i): g.message(Msg(s + 1, s, cuts[s])) for s in range(p - 1)
            for i in range(chunks)}  # fmt: skip
    for s in range(p):
        lane = g.lane(s)
        lane.append(Compute(rest, "overhead"))
        lane.extend(Post(act[(s - 1, i)]) for i in range(chunks) if s > 0)
        lane.extend(Post(grad[(s, i)]) for i in range(chunks) if s < p - 1)
        sent = []
        for step in gpipe_steps(s, p, chunks):
            i = step.micro_batch
            forward = step.op == "fwd"
            waits = act.get((s - 1, i)) if forward else grad.get((s, i))
            sends = act.get((s, i)) if forward else grad.get((s - 1, i))
            if waits is not None:
                lane.append(Wait(waits))
            lane.append(Compute((fwd if forward else bwd) * shares[s], f"{step.op[0].upper()}{i}"))
            if sends is not None:
                lane.append(Post(sends))
                sent.append(sends)
                if per_send:
                    lane.append(Comm(per_send, "communication CPU", on_cores=True))
        lane.extend(map(Wait, sent))
    return g


def tp_graph(prof: Profile, p: int, topo: Topology, cores: int | None,
             weak: bool = False) -> Graph:  # fmt: skip
    if prof.max_devices and p > prof.max_devices:
        raise NotApplicable(f"{p}-way split > {prof.limit}")
    if prof.model and prof.model_s:
        # the busiest rank's share of the model at p over the measured one; the step's
        # overhead (loop, optimiser, data) is not split
        # (timed on this machine when predicting it: see simulate/tp_share.py)
        measure = prof.global_batch if cores is not None else 0
        ratio = (busiest_share(prof.model, p, measure)
                 / busiest_share(prof.model, prof.world, measure))  # fmt: skip
        work = prof.compute_s - prof.model_s + prof.model_s * ratio
        # the ranks together: the busiest one's work less what an uneven cut spares the rest
        spared = prof.model_s * ratio * (1 - mean_over_busiest(prof.model, p))
        demand = p * (work - spared) / work if work else p
    else:  # a user's own run: every layer assumed split evenly
        work, demand = prof.compute_s * prof.world / p, p
    sizes = tp_allreduces(prof, p)
    # the ranks' CPU for moving the bytes, as measured, scaled by the bytes each rank sends
    # in the ring allreduces at p over at the measured size
    sent = sum(2 * (p - 1) / p * b for b in sizes)
    measured = sum(2 * (prof.world - 1) / prof.world * b for b in tp_allreduces(prof, prof.world))
    cpu = communication_cpu(prof, cores) * (sent / measured if measured else 1.0)
    g = Graph(weight={0: demand})  # the ranks' compute on shared cores
    lane = g.lane(0)
    for nbytes in sizes:
        lane.extend([Compute(work / (len(sizes) + 1)),
                     Comm(_allreduce_s("ring", nbytes, p, topo), "allreduce")])  # fmt: skip
        if cpu:
            lane.append(Comm(cpu / len(sizes), "communication CPU", on_cores=True))
    lane.append(Compute(work / (len(sizes) + 1)))
    return g


def hybrid_graph(prof: Profile, p: int, topo: Topology, cores: int | None,
                 weak: bool = False) -> Graph:  # fmt: skip
    mp = int(prof.options.get("mp") or 2)
    if p % mp:
        raise NotApplicable(f"{p} devices do not split into replicas of mp = {mp}")
    dp, dp0 = p // mp, max(prof.world // mp, 1)
    work = prof.compute_s * (1.0 if weak else dp0 / dp)
    g = Graph(weight={0: p})
    g.lane(0).extend(
        [Compute(work), Comm(_allreduce_s("ring", prof.grad_bytes // mp, dp, topo), "dp ring")]
    )
    return g  # fmt: skip


def _ring_phase_s(nbytes: int, p: int, topo: Topology) -> float:
    """One reduce-scatter or all-gather of ``nbytes`` on the ring of ``p`` ranks."""
    link = topo.slowest(p)
    return all_gather_cost([max(nbytes // 4 // p, 1)] * p).time(link.alpha, link.beta)


def zero_graph(prof: Profile, p: int, topo: Topology, cores: int | None,
               weak: bool = False) -> Graph:  # fmt: skip
    stage = int(prof.options.get("stage", 3))
    work = prof.compute_s * batch_share(prof, p, weak)
    bwd = min(prof.backward_s, prof.batch_s) * (1.0 if weak else sample_scale(prof, p))
    units = max(prof.buckets, 1)
    phase = _ring_phase_s(prof.grad_bytes // units, p, topo)
    g = Graph(weight={0: p})
    main, bg = g.lane(0), g.lane(0, "bg")

    def collective(after: int, frac: float, seconds: float, name: str) -> int:
        bg.extend([After((0, "main"), after, frac), Comm(seconds, name)])
        return len(bg)  # the main lane joins this many background ops

    if stage < 3:
        grad_s = _allreduce_s("ring", prof.grad_bytes // units, p, topo) if stage == 1 else phase
        main.append(Compute(work - bwd, "forward"))
        for _ in range(units):
            if bwd > 0:
                main.append(Compute(bwd / units, "backward"))
            collective(len(main) - 1, 1.0, grad_s, "gradients")
        main.extend([Join((0, "bg"), len(bg)), Comm(units * phase, "all-gather weights")])
        return g
    backward = bwd if bwd > 0 else 2 * work / 3
    forward = min(backward / 2, work - backward) if bwd > 0 else work / 3
    main.append(Compute(max(work - forward - backward, 0.0), "optimizer, loop"))
    started, frac = len(main) - 1, 1.0
    for _ in range(units):  # each unit gathered before its forward, the next one meanwhile
        ready = collective(started, frac, phase, "all-gather (forward)")
        main.extend([Join((0, "bg"), ready), Compute(forward / units, "forward")])
        started, frac = len(main) - 1, 0.0
    ready = collective(started, 1.0, phase, "all-gather (backward)")
    for k in range(units):
        main.extend([Join((0, "bg"), ready), Compute(backward / units, "backward")])
        if k + 1 < units:
            ready = collective(len(main) - 1, 0.0, phase, "all-gather (backward)")
        collective(len(main) - 1, 1.0, phase, "reduce-scatter")
    main.append(Join((0, "bg"), len(bg)))
    return g


BUILDERS = {
    "allreduce": data_parallel_graph, "ddp": data_parallel_graph,
    "local_sgd": data_parallel_graph, "ps": ps_graph, "async_ps": ps_graph,
    "pipeline": pipeline_graph, "layerwise": pipeline_graph, "tp": tp_graph,
    "hybrid": hybrid_graph, "zero": zero_graph,
}  # fmt: skip


def build(prof: Profile, p: int, topo: Topology, cores: int | None = None,
          weak: bool = False) -> Graph:  # fmt: skip
    """The step graph of ``prof``'s strategy at ``p`` devices (raises :class:`NotApplicable`)."""
    if p < 1:
        raise ValueError(f"devices must be >= 1, got {p}")
    return BUILDERS[prof.family](prof, p, topo, cores, weak)
