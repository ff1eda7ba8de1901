"""How well the simulator predicts this machine: replay and 2 -> 3, 4 scale-out rows.

:func:`measure` trains each strategy at 2, 3 and 4 workers through the compare's own runner
(:func:`lightning_par.measure.run.run_all`: one ``Trainer.fit`` per row, probes and traces
kept), interleaved over ``rounds`` (every strategy and size once per round, so load that comes
and goes on a shared machine hits all alike). Each (strategy, size)'s fastest round is the
one measured; every round is kept, and each row reports their ``spread``
(``(slowest - fastest) / fastest`` step) and ``steps_s`` beside its error: a noisy row still
counts.

:func:`rows` then reports, per strategy:

* ``replay``: the fastest p = 2 run replayed on its own fitted loopback link
  (:func:`~.replay.replay`) against its measured step;
* ``scale 2->3`` / ``scale 2->4``: the strategy's :class:`~.profile.Profile` at p = 2 built
  at 3 and 4 workers (:func:`~.scale.predict_step`) against the fastest measured 3- and
  4-worker runs. The profile holds what load moves least (:mod:`.base`: each rank's CPU
  time for compute, every traced span at its best round, messages priced by their fastest
  repetitions) and the row says how noisy its base rounds were (``base``). This box has few
  cores, so 3 or 4 workers oversubscribe it: the prediction replays the graph with its
  ranks sharing this machine's cores (:mod:`~.cores`: only ranks computing or moving bytes
  at the same time share, with the threads Lightning gives each rank, less the cores'
  worth other processes took while the measured run ran, its ``other_load``; the model's
  step at each size's batch and the cost of taking turns on the cores,
  :mod:`~.sharing_cost` measures before the runs and records with them). Each
  scale row also carries the predicted per-step split (:func:`~.scale.predict_split`: the
  CPU the ranks compute and communicate, the time they wait for a core, for messages and
  for each other) and the measured one (:func:`measured_split`), which say where a miss
  comes from. What the model leaves out of the measured 2-worker step (the ranks' drift
  between steps) is the row's ``offset_s``, added once per step at 3 and 4 (not once per
  message: it is not latency, and a larger collective has more messages).

``error = (predicted - measured) / measured``; every row is reported, misses included.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from lightning_par.measure.analyse import analyse
from lightning_par.measure.run import run_all
from lightning_par.simulate.base import (
    Base,
    base_profile,
    compute_per_step,
    fastest_link,
    spread,
)
from lightning_par.simulate.graph import transfer_samples
from lightning_par.simulate.links import Link, Topology, fit_link
from lightning_par.simulate.machine import Machine, measure_machine, recorded_machine
from lightning_par.simulate.other_load import QUIET_LOAD
from lightning_par.simulate.profile import Profile
from lightning_par.simulate.replay import Run, load_run, replay
from lightning_par.simulate.scale import on_this_machine, predict_split, predict_step

#: The strategies the issue asks to validate: the allreduce family, servers, pipeline, tensor.
VALIDATED = ("ring_allreduce", "tree_allreduce", "butterfly_allreduce", "round_robin_allreduce",
             "all_to_all_allreduce", "master_worker_allreduce", "parameter_server", "gpipe",
             "tensor_parallel")  # fmt: skip
SIZES = (2, 3, 4)
#: Families whose ranks do not pay the cost of taking turns that :mod:`.sharing_cost` times
#: on the data-parallel step: tensor-parallel ranks, which in two quiet validations spent
#: 0.95 to 1.06 times the CPU at 3 and 4 workers that their busiest share alone gives (the
#: cost read 1.15 to 1.22 there, and data-parallel ranks spent 1.01 to 1.30 times theirs);
#: paying it predicted their steps 9 to 15 % long.
NO_TURN_COST = ("tp",)


def measure(work: Path, strategies=VALIDATED, rounds: int = 2, steps: int = 10, warmup: int = 4,
            batch: int = 48, timeout: float = 180
            ) -> dict[tuple[str, int], list[Path]]:  # fmt: skip
    """Run every (strategy, size) ``rounds`` times, interleaved; :func:`kept_rounds`."""

    rows = []
    for round_ in range(rounds):
        for p in SIZES:
            for name in strategies:
                folder = work / f"{round_}-p{p}-{name}"
                rows.append({"index": len(rows), "round": round_, "strategy": name,
                             "model": "CifarCNN", "accelerator": "cpu", "steps": steps,
                             "source": "cifar10-mini", "devices": p, "global_batch": batch,
                             "folder": str(folder)})  # fmt: skip
    # kept with each run: --reuse may read them elsewhere
    machine = measure_machine(SIZES, "CifarCNN", batch).as_row()
    results = run_all(rows, timeout)
    for row in rows:
        result, folder = results.get(row["index"], {}), Path(row["folder"])
        if "error" not in result and (folder / "probe").is_dir():
            (folder / "row.json").write_text(json.dumps({**row, **result, "warmup": warmup,
                                                         **machine}))  # fmt: skip
    return kept_rounds(work)


def kept_rounds(work: Path) -> dict[tuple[str, int], list[Path]]:
    """Every round of each (strategy, workers) among the run folders :func:`measure` kept
    in ``work``, the fastest first (``--validate --reuse DIR`` reads them again without
    training)."""

    found: dict[tuple[str, int], list[tuple[float, Path]]] = {}
    for marker in sorted(work.glob("*/row.json")):
        row = json.loads(marker.read_text())
        step = analyse(marker.parent, row["warmup"], row["global_batch"])["step_s"]
        found.setdefault((row["strategy"], row["devices"]), []).append((step, marker.parent))
    order = {name: i for i, name in enumerate(VALIDATED)}
    keys = sorted(found, key=lambda k: (order.get(k[0], len(order)), k[1]))
    return {key: [folder for _, folder in sorted(found[key])] for key in keys}


def pooled_loopback(runs: list[Run]) -> Link:
    """One loopback link fitted to the transfers of every run (sizes from 80 B to MBs)."""

    return fit_link([s for run in runs for s in transfer_samples(run.traces)])


def rows(found: dict[tuple[str, int], list[Path]], machine: Machine | None = None
         ) -> list[dict]:  # fmt: skip
    """The validation table from :func:`measure`'s folders, every round of each (strategy,
    size), the fastest first (see the module docstring). ``machine``: the measuring one
    (default: :func:`.machine.recorded_machine`)."""
    runs = {key: [load_run(folder) for folder in folders] for key, folders in found.items()}
    machine = machine or recorded_machine([r[0] for r in runs.values()])
    # the link where a strategy traced no transfer of its own: every 2-worker run's
    loop = pooled_loopback([rounds[0] for (_, p), rounds in runs.items() if p == SIZES[0]])
    out = []
    for name in dict.fromkeys(n for n, _ in found):
        if (name, SIZES[0]) not in runs:
            continue
        base = runs[(name, SIZES[0])]
        small = base[0]
        own = own_link(small, loop)
        result = replay(small, Topology(own, own), link=own)
        out.append(_row(name, "replay", base, result.mean_step_s))
        link = fastest_link(base, loop)
        topo = Topology(link, link)
        start = base_profile(base, link)
        for p in SIZES[1:]:
            if (name, p) not in runs:
                continue
            big = runs[(name, p)]
            guess, split, offset = scaled(start, p, topo, big[0].other_load or 0.0, machine)
            row = _row(name, f"scale 2->{p}", big, guess)
            row.update(predicted_split=split, offset_s=offset, base=start.noise.as_dict(),
                       link={"alpha_s": link.alpha, "beta_s_per_byte": link.beta},
                       measured_split=measured_split(big[0], loop))  # fmt: skip
            out.append(row)
    return out


def scaled(start: Base | Profile, p: int, topo: Topology, other_load: float = 0.0,
           machine: Machine | None = None) -> tuple[float, dict[str, float], float]:  # fmt: skip
    """The step at ``p`` predicted from a strategy's base runs: the model's step at ``p``
    from ``start``'s profile (:class:`~.base.Base`: each figure at its best round) plus what
    the model leaves out of the fastest quiet base round's measured step (the offset,
    returned too: that round's step less the model of it, from its own figures), once per
    step; none where every base round ran beside other processes' load (there a model of
    the load's error, not the framework's, would be carried: -14 ms for one parameter
    server beside a busy core, predicting its quiet 3-worker run 38 % short). A bare
    :class:`~.profile.Profile` is its own fastest round, beside no other load.
    ``other_load``: the cores' worth other processes took beside the run at ``p``
    (:func:`.cores.capacity`). ``machine``: the cores, threads, timed steps and the cost
    of taking turns on the cores the prediction replays the graph with (``None``: every
    rank a processor of its own)."""
    if isinstance(start, Profile):
        prof = fastest = start
        measured_s, base_load = start.step_s, 0.0
    else:
        prof, fastest = start.profile, start.fastest
        measured_s, base_load = start.fastest_run.measured_step_s, start.fastest_run.other_load
    on = {} if machine is None else {"cores": machine.cores, "threads": machine.threads}
    offset = 0.0  # what the model leaves out: read where it holds, beside no other load
    if (base_load or 0.0) <= QUIET_LOAD:
        model = predict_step(fastest, fastest.world, topo, other_load=base_load or 0.0, **on)
        offset = (measured_s or 0.0) - model
    cost = 1.0
    if machine is not None:
        prof = on_this_machine(prof, p, machine.step_cpu)
        cost = 1.0 if prof.family in NO_TURN_COST else machine.sharing_cost.get(p, 1.0)
    guess, split = predict_split(prof, p, topo, other_load=other_load, turn_cost=cost, **on)
    return guess + offset, split, offset


def measured_split(run: Run, pooled: Link) -> dict[str, float]:
    """The run's per-step ``compute`` (its graph's compute spans, mean over ranks, as
    :class:`~.profile.Profile` reads them) and the rest of its measured step,
    ``communication_and_waiting``, to set beside the scale-out's predicted split; where the
    probes kept CPU clocks, also the main threads' ``cpu`` (compute less its wait for a
    core) and the ``communication_cpu`` of the other threads (mean over ranks)."""

    compute = statistics.fmean(compute_per_step(run.graph(own_link(run, pooled))).values())
    step = run.measured_step_s or 0.0
    out = {"compute": compute, "communication_and_waiting": max(step - compute, 0.0)}
    cpu, process = run.clock_per_step("cpu"), run.clock_per_step("process_cpu")
    if cpu and process:
        out["cpu"] = statistics.fmean(cpu.values())
        out["communication_cpu"] = statistics.fmean(max(process[r] - cpu[r], 0.0) for r in cpu)
    return out


def own_link(run: Run, pooled: Link) -> Link:
    """The run's loopback fitted to its own transfers, or ``pooled`` where it has none."""
    try:
        return run.loopback()
    except ValueError:  # no matched messages (servers are untraced): the pooled fit
        return pooled


def _row(name: str, kind: str, rounds: list[Run], predicted: float) -> dict:
    """One row: the fastest of ``rounds`` measured against ``predicted``, with every round's
    step, their spread and the other load beside the fastest."""
    measured = rounds[0].measured_step_s
    error = (predicted - measured) / measured if measured else None
    steps = [run.measured_step_s for run in rounds if run.measured_step_s]
    return {"strategy": name, "kind": kind, "measured_s": measured, "predicted_s": predicted,
            "error": error, "steps_s": steps, "spread": spread(steps),
            "other_load": rounds[0].other_load}  # fmt: skip
