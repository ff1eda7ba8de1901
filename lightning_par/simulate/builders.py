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
* **gpipe / layerwise**, **tensor_parallel**, **hybrid**: :mod:`.model_parallel_graphs`.
* **zero**: the measured units (buckets) on one communication lane, each ring phase
  ``(p-1)(alpha + beta S)`` for a unit of ``p S`` bytes. Stage 1: the allreduce family's
  buckets, then an all-gather of every unit after the step; stage 2: a reduce-scatter per
  unit behind backward, then the all-gathers; stage 3: forward and backward in one slice
  per unit (backward twice the forward), each waiting for its unit's all-gather, the next
  one prefetched while it computes, a reduce-scatter after each backward slice.
* Where the ranks share this machine's cores (``cores``), each pays its measured
  communication CPU (:func:`.step_costs.communication_cpu`) as work that shares them too.
"""

from __future__ import annotations

from lightning_par.simulate.links import Topology
from lightning_par.simulate.model_parallel_graphs import hybrid_graph, pipeline_graph, tp_graph
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
from lightning_par.simulate.step_costs import (
    allreduce_s,
    batch_share,
    communication_cpu,
    ring_phase_s,
    sample_scale,
)

__all__ = ["BUILDERS", "NotApplicable", "build"]


def data_parallel_graph(prof: Profile, p: int, topo: Topology, cores: int | None,
                        weak: bool = False) -> Graph:  # fmt: skip
    work = prof.compute_s * batch_share(prof, p, weak)
    bwd = min(prof.backward_s, prof.batch_s) * (1.0 if weak else sample_scale(prof, p))
    g = Graph(weight={0: p})
    main = g.lane(0)
    if prof.family == "local_sgd":
        period = int(prof.options.get("period") or 1)
        main.append(Compute(work))
        main.append(Comm(allreduce_s(prof.algorithm, prof.grad_bytes, p, topo) / period,
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
    each = allreduce_s(prof.algorithm, prof.grad_bytes // buckets, p, topo)
    cpu = communication_cpu(prof, cores) / buckets
    for _ in range(buckets):
        if bwd > 0:
            main.append(Compute(bwd / buckets, "backward"))
        bg.extend([After((0, "main"), len(main) - 1, 1.0), Comm(each, "allreduce bucket")])
        if cpu:
            bg.append(Comm(cpu, "communication CPU", on_cores=True))
    main.append(Join((0, "bg"), len(bg)))
    return g


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


def zero_graph(prof: Profile, p: int, topo: Topology, cores: int | None,
               weak: bool = False) -> Graph:  # fmt: skip
    stage = int(prof.options.get("stage", 3))
    work = prof.compute_s * batch_share(prof, p, weak)
    bwd = min(prof.backward_s, prof.batch_s) * (1.0 if weak else sample_scale(prof, p))
    units = max(prof.buckets, 1)
    phase = ring_phase_s(prof.grad_bytes // units, p, topo)
    g = Graph(weight={0: p})
    main, bg = g.lane(0), g.lane(0, "bg")

    def collective(after: int, frac: float, seconds: float, name: str) -> int:
        bg.extend([After((0, "main"), after, frac), Comm(seconds, name)])
        return len(bg)  # the main lane joins this many background ops

    if stage < 3:
        grad_s = allreduce_s("ring", prof.grad_bytes // units, p, topo) if stage == 1 else phase
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
