"""The step graphs of the model-parallel strategies at ``p`` devices (see :mod:`.builders`):

* **gpipe / layerwise**: ``K = p`` stage lanes running
  :func:`lightning_par.pipeline.schedule.gpipe_steps` for ``M`` micro-batches (layerwise: 1),
  activations and gradients as messages between neighbours; each stage computes its share
  of the measured model under the strategy's own cut at ``p`` (:mod:`.stage_share`), and
  on shared cores each stage is placed whole on one (:func:`.cores.place`).
* **tensor_parallel**: the busiest rank computes its slice of every layer the automatic plan
  cuts at ``p`` and every other layer whole (:mod:`.tp_share`); the step's overhead outside
  forward and backward is not split; the plan's allreduces at ``p``, each a ring allreduce.
  A user's own run (no compare model to plan) assumes every layer split evenly.
* **hybrid**: its ``mp`` stays as measured, ``dp = p / mp`` replicas ring-allreduce ``1/mp``
  of the gradients.
"""

from __future__ import annotations

from lightning_par.pipeline.schedule import gpipe_steps
from lightning_par.simulate.links import Topology
from lightning_par.simulate.ops import Comm, Compute, Graph, Msg, NotApplicable, Post, Wait
from lightning_par.simulate.profile import Profile
from lightning_par.simulate.stage_share import stages_at
from lightning_par.simulate.step_costs import allreduce_s, communication_cpu
from lightning_par.simulate.tp_share import busiest_share, mean_over_busiest, tp_allreduces


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
                     Comm(allreduce_s("ring", nbytes, p, topo), "allreduce")])  # fmt: skip
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
        [Compute(work), Comm(allreduce_s("ring", prof.grad_bytes // mp, dp, topo), "dp ring")]
    )
    return g  # fmt: skip
