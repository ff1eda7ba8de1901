"""What a small run tells the scale-out builders: per-step compute, buckets, bytes, schedule.

:func:`profile` reads one run (:class:`~.replay.Run`, a strategy at ``p`` ranks) and keeps
only what does not depend on ``p`` or on the network: the compute of a step (the main lane's
:class:`~.ops.Compute` in the replayed graph, mean over ranks), its backward and buckets
(data parallel), the pipeline's forward and backward per micro-batch summed over stages, the
bytes of each collective or message, and the model's limits (a pipeline cannot have more
stages than the network has layers; tensor parallelism cannot split a layer narrower than
its ranks).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from lightning_par.measure.run import make_model
from lightning_par.simulate.ops import Compute, Graph
from lightning_par.simulate.replay import Run
from lightning_par.strategies.registry import spec

ALLREDUCE_KIND = "allreduce"


@dataclass
class Profile:
    strategy: str
    family: str  # allreduce, local_sgd, ps, async_ps, pipeline, layerwise, tp, hybrid, ddp, zero
    world: int  # workers of the measured run
    processes: int  # processes of the measured run (servers included)
    global_batch: int
    step_s: float  # measured step
    compute_s: float  # the main lane's compute per step
    options: dict = field(default_factory=dict)
    algorithm: str = "ring"
    grad_bytes: int = 0
    backward_s: float = 0.0
    #: The part of ``compute_s`` that scales with the samples a rank computes: forward and
    #: backward, ``3/2`` of the backward (backward costs about twice the forward: Kaplan et
    #: al. 2020, "Scaling Laws for Neural Language Models", section 2.1). The rest (the
    #: framework's loop, the optimiser) is per step. All of it where backward is not traced.
    batch_s: float = 0.0
    buckets: int = 1
    servers: int = 0
    server_s: float = 0.0
    chunks: int = 1
    fwd_s: float = 0.0  # per micro-batch, all stages together
    bwd_s: float = 0.0
    #: each stage's forward + backward per micro-batch, in the measured run's order
    #: (:func:`~.stage_share.stages_at` splits them over the layers each stage held)
    stage_s: tuple[float, ...] = ()
    act_bytes: int = 0
    collectives: int = 0  # tensor parallel: allreduces per step
    collective_bytes: int = 0
    max_devices: int | None = None
    limit: str = ""
    traced: bool = True
    #: the compare's model name (``make_model``; tensor parallel and pipelines read its
    #: layers at ``p``), "" for a user's own run
    model: str = ""
    #: tensor parallel: the model's forward and backward per step without their collectives
    #: (the ``tp forward`` / ``tp backward`` spans less the messages inside them); the rest of
    #: ``compute_s`` is the step's overhead, which no rank splits.
    model_s: float = 0.0
    #: the optimizer state the fullest rank held at the end of the measured run (its probe)
    optimizer_bytes: int = 0
    #: the compute figures are CPU time (:mod:`.base`), not wall time that may hold waits
    #: for a core; ``comm_cpu_s``: CPU per step beyond the main thread's (communication)
    cpu_based: bool = False
    comm_cpu_s: float = 0.0
    #: per size ``p``: a data-parallel rank's per-sample work at ``p`` over at ``world``,
    #: where the model's step was timed on both batches on this machine
    #: (:mod:`.sharing_cost`); ``world / p`` where absent
    sample_scale: dict[int, float] = field(default_factory=dict)


FAMILIES = {
    "gpipe": "pipeline", "layerwise": "layerwise", "tensor_parallel": "tp",
    "parameter_server": "ps", "async_sgd": "async_ps", "local_sgd": "local_sgd",
    "hybrid": "hybrid", "lightning_ddp": "ddp", "zero": "zero",
}  # fmt: skip


def _model_limits(model_name: str | None) -> tuple[int, int, int]:
    """(parameter bytes, layers of ``module.net``, narrowest conv/linear output width)."""
    if not model_name:
        return 0, 0, 0
    from torch import nn

    model = make_model(model_name)
    widths = [m.out_channels for m in model.modules() if isinstance(m, nn.Conv2d)]
    widths += [m.out_features for m in model.modules() if isinstance(m, nn.Linear)]
    layers = len(getattr(model, "net", [])) if isinstance(getattr(model, "net", None),
                                                          nn.Sequential) else 0  # fmt: skip
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return params, layers, min(widths, default=0)


def _per_step(graph: Graph) -> float:
    totals = [sum(op.seconds for op in graph.lanes[(r, "main")] if isinstance(op, Compute))
              for r in graph.ranks if (r, "main") in graph.lanes]  # fmt: skip
    return statistics.fmean(totals) / graph.steps


def _took(event, cpu: bool) -> float:
    """A span's seconds: its CPU time with ``cpu`` where the trace recorded it, else wall."""
    return event.cpu if cpu and event.cpu is not None else event.end - event.start


def profile(run: Run, graph: Graph | None = None, cpu: bool = False) -> Profile:
    """The :class:`Profile` of ``run`` (its ``row.json`` names the strategy, the options the
    run added to it, and the model). ``cpu``: each traced span counts the CPU time its thread
    ran in it (:attr:`~lightning_par.comm.trace.Event.cpu`) where the trace has it, not its
    wall time (see :mod:`.base`)."""
    name = run.row.get("name") or run.row.get("strategy", run.name)
    options = {**spec(name).options, **run.row.get("options", {})} if name else {}
    family = FAMILIES.get(name, ALLREDUCE_KIND if name.endswith("_allreduce") else "")
    if not family:
        raise ValueError(f"{name}: no scale-out model for this strategy")
    graph = graph or run.graph()
    steps = graph.steps
    params, layers, width = _model_limits(run.row.get("model"))
    world = int(run.row.get("devices", run.world))
    events = [e for t in run.traces for e in t.events if _in_window(run, t, e.start)]
    messages = [m for t in run.traces for m in t.messages
                if m.rank == t.rank and _in_window(run, t, m.start)]  # fmt: skip
    n_ranks = max(len(run.traces), 1)
    step_s = run.measured_step_s or 0.0
    prof = Profile(run.row.get("strategy", name), family, world,
                   world + int(run.row.get("servers", 0) or 0),
                   int(run.row.get("global_batch", 0)), step_s, _per_step(graph), options,
                   options.get("algorithm", "ring"), params)  # fmt: skip
    backward = [_took(e, cpu) for e in events if e.name == "backward"]
    prof.backward_s = sum(backward) / n_ranks / steps if backward else 0.0
    prof.batch_s = min(1.5 * prof.backward_s, prof.compute_s) if backward else prof.compute_s
    bucket_events = [e for e in events if e.name.startswith(("bucket", "reduce-scatter"))]
    prof.buckets = max(1, round(len(bucket_events) / n_ranks / steps))
    if family in ("ps", "async_ps"):
        prof.servers = len({m.peer for m in messages if m.peer >= len(run.traces)}) or 1
        prof.processes = world + prof.servers
        pulls = [g for g in graph.messages if g.one_sided and g.dst < len(run.traces)]
        prof.server_s = statistics.median(m.extra_s for m in pulls) if pulls else 0.0
    if family in ("pipeline", "layerwise", "hybrid"):
        prof.model = run.row.get("model") or ""
        fwd = [_took(e, cpu) for e in events if e.name == "fwd"]
        bwd = [_took(e, cpu) for e in events if e.name == "bwd"]
        micro = {e.micro_batch for e in events if e.name == "fwd"}
        prof.chunks = max(1, len(micro))
        prof.fwd_s = sum(fwd) / steps / prof.chunks
        prof.bwd_s = sum(bwd) / steps / prof.chunks
        per_rank = [sum(_took(e, cpu) for e in t.events if e.name in ("fwd", "bwd")
                        and _in_window(run, t, e.start))
                    for t in sorted(run.traces, key=lambda t: t.rank)]  # fmt: skip
        if family != "hybrid" and len(per_rank) == world:
            prof.stage_s = tuple(s / steps / prof.chunks for s in per_rank)
        acts = [m.nbytes for m in messages if m.tag == "act" and m.op == "send"]
        prof.act_bytes = int(statistics.median(acts)) if acts else 0
        prof.max_devices, prof.limit = layers or None, f"{layers} layers in module.net"
    if family == "tp":
        prof.model = run.row.get("model") or ""
        prof.model_s = _model_compute(run, events, messages, cpu) / n_ranks / steps
        scatters = [m for m in messages if m.op == "send" and m.tag.endswith("reduce-scatter")]
        prof.collectives = round(len(scatters) / n_ranks / steps)
        # at p ranks a ring allreduce's reduce-scatter step carries 1/p of the tensor
        prof.collective_bytes = int(statistics.median(m.nbytes for m in scatters)) * world
        prof.max_devices, prof.limit = width or None, f"narrowest layer is {width} wide"
    held = [p.get("held_bytes", {}) for p in run.probes.values()]
    prof.optimizer_bytes = max((h.get("optimizer", 0) for h in held), default=0)
    if family == "zero" and not params:  # a user's own run: the parameters it held
        stage3 = int(options.get("stage", 3)) == 3
        whole = max((h.get("parameters", 0) for h in held), default=0)
        prof.grad_bytes = whole * (world if stage3 else 1)
    if family == "ddp" or not prof.compute_s:
        prof.traced, prof.compute_s = False, step_s  # untraced: the step is all compute
        prof.batch_s = step_s
    return prof


def _model_compute(run: Run, events, messages, cpu: bool = False) -> float:
    """Seconds inside ``tp forward`` / ``tp backward`` spans, less the time a rank blocked on
    a message inside them (all ranks together); with ``cpu``, the CPU time the spans
    recorded (a rank blocked on a message sleeps), where they did."""
    model = [e for e in events if e.name in ("tp forward", "tp backward")]
    if cpu and model and all(e.cpu is not None for e in model):
        return sum(e.cpu for e in model)
    spans = [(e.rank, e.start, e.end) for e in model]
    total = sum(b - a for _, a, b in spans)
    for m in messages:
        blocked = max(m.start, m.wait_start if m.wait_start is not None else m.start)
        if any(r == m.rank and a <= blocked and m.end <= b for r, a, b in spans):
            total -= m.end - blocked
    return max(total, 0.0)


def profile_from_report(row: dict, model_name: str) -> Profile | None:
    """A coarser :class:`Profile` from one row of a compare ``report.json`` (no traces):
    compute and bytes per step only, so no overlap with backward and no per-step compute
    split. ``None`` for strategies whose scale-out needs the traces (tensor parallel,
    hybrid, layerwise) or that failed."""
    name = row.get("name", row["strategy"])
    family = FAMILIES.get(name, ALLREDUCE_KIND if name.endswith("_allreduce") else "")
    if row.get("status") != "ok" or family in ("", "tp", "hybrid", "layerwise"):
        return None
    options = {**spec(name).options, **row.get("options", {})}
    params, layers, _ = _model_limits(model_name)
    compute = row["compute_s"] if row.get("compute_s") is not None else row["step_s"]
    prof = Profile(row["strategy"], family, int(row["workers"]), int(row["processes"]),
                   int(row["global_batch"]), row["step_s"], compute, options,
                   options.get("algorithm", "ring"), params, batch_s=compute,
                   servers=int(row.get("servers") or 0),
                   traced=bool(row.get("traced")))  # fmt: skip
    if family == "pipeline":
        prof.chunks = int(options.get("chunks", 4))
        prof.act_bytes = int((row.get("bytes_sent_per_step") or 0) / prof.chunks)
        prof.max_devices, prof.limit = layers or None, f"{layers} layers in module.net"
    return prof


def _in_window(run: Run, trace, t: float) -> bool:
    if not run.windows or trace.rank not in run.windows:
        return True
    w = run.windows[trace.rank]
    return w[0][0] <= trace.origin + t < w[-1][1]
