"""``python -m lightning_par.simulate``: replay traces on other links, scale them out, validate.

Three uses::

    # predicted step, throughput and efficiency of every strategy of a compare run
    python -m lightning_par.simulate --from runs/compare --devices 8,64,512 --link nvlink+ib
    # one run's traces (a compare run folder, or any plugin's trace_dir) on another machine
    python -m lightning_par.simulate --replay runs/compare/runs/gpipe --link nvlink --speedup 400
    # how well it predicts this machine (trains each strategy at 2, 3 and 4 workers)
    python -m lightning_par.simulate --validate --json

Links: loopback (fitted to the traces), pcie, nvlink, eth100, ib, or ``intra+inter``
(``--per-node`` devices per node). ``--speedup 400`` runs compute 400 times faster than it
was measured. Everything printed is a prediction of the alpha-beta model; see
``docs/simulate.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from lightning_par.launch.processes import exit_on_sigterm
from lightning_par.quiet import quiet_lightning
from lightning_par.simulate import timings
from lightning_par.simulate.engine import simulate
from lightning_par.simulate.links import PRESETS, parse_topology
from lightning_par.simulate.machine import kept_machine
from lightning_par.simulate.profile import profile
from lightning_par.simulate.replay import load_run
from lightning_par.simulate.report import (
    base_table,
    scaling_figure,
    scaling_table,
    side_by_side,
    split_table,
    validation_table,
)
from lightning_par.simulate.scale import scaling_row
from lightning_par.simulate.validate import (
    VALIDATED,
    kept_rounds,
    measure,
    own_link,
    pooled_loopback,
    rows,
)

DEFAULT_DEVICES = "8,64,512"
CURVE = [2**k for k in range(1, 11)]


def _devices(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--devices {text!r}: give counts like 8,64,512") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"--devices {text!r}: counts must be >= 1")
    return values


def _speeds(items: list[str]) -> dict[int, float]:
    out = {}
    for item in items:
        rank, _, factor = item.partition("=")
        try:
            out[int(rank)] = float(factor)
        except ValueError:
            message = f"--rank-speed {item!r}: write RANK=FACTOR (1=0.5: rank 1 twice as slow)"
            raise argparse.ArgumentTypeError(message) from None
    return out


def _strategies(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [n for n in names if n not in VALIDATED]
    if not names or unknown:
        raise argparse.ArgumentTypeError(
            f"--strategies {text!r}: choose from {','.join(VALIDATED)} (the validated ones)"
        )
    return names


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m lightning_par.simulate",
                                     description="Replay traces on other links and devices, "
                                     "scale them out, validate against this machine.",
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])  # fmt: skip
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument(
        "--from",
        dest="source",
        metavar="DIR",
        help="a compare report folder (its runs/<strategy>/ are read)",
    )
    what.add_argument("--replay", metavar="DIR", help="one run folder or trace folder")
    what.add_argument(
        "--validate",
        action="store_true",
        help="train at 2, 3, 4 workers here and compare (minutes)",
    )
    parser.add_argument(
        "--devices",
        type=_devices,
        default=_devices(DEFAULT_DEVICES),
        help=f"--from: device counts of the table (default {DEFAULT_DEVICES})",
    )
    parser.add_argument("--link", default="nvlink+ib", help="preset or intra+inter")
    parser.add_argument("--per-node", type=int, default=8, help="devices per node")
    parser.add_argument(
        "--speedup",
        type=float,
        default=1.0,
        help="compute runs this many times faster than measured",
    )
    parser.add_argument(
        "--rank-speed",
        nargs="*",
        default=[],
        metavar="RANK=F",
        help="--replay: one rank's own speed factor (0.5: twice as slow)",
    )
    parser.add_argument(
        "--contention", action="store_true", help="--replay: transfers at once share a rank's link"
    )
    parser.add_argument("--out", default="runs/simulate", help="folder of figures")
    parser.add_argument("--rounds", type=int, default=2, help="--validate: runs per size")
    parser.add_argument(
        "--strategies",
        type=_strategies,
        default=list(VALIDATED),
        help="--validate: which of the validated strategies to train, comma-separated "
        "(default: all)",
    )
    parser.add_argument("--work", help="--validate: keep the runs here (default: temporary)")
    parser.add_argument(
        "--reuse", metavar="DIR", help="--validate: the runs a --work DIR kept (no training)"
    )
    parser.add_argument("--json", action="store_true", help="print JSON")
    args = parser.parse_args(argv)
    if args.speedup <= 0 or args.per_node < 1 or args.rounds < 1:
        parser.error("--speedup must be > 0, --per-node and --rounds >= 1")
    try:
        args.rank_speed = _speeds(args.rank_speed)
        _topology(args, None)
    except (ValueError, argparse.ArgumentTypeError) as err:
        parser.error(str(err))
    for folder in (args.source, args.replay, args.reuse):
        if folder and not Path(folder).is_dir():
            parser.error(f"{folder} is not a folder (run python -m lightning_par.compare first, "
                         "or give a strategy's trace_dir)")  # fmt: skip
    return args


def _topology(args, loopback):
    return parse_topology(args.link, args.per_node, loopback)


def _run_folders(source: Path) -> list[Path]:
    base = source / "runs" if (source / "runs").is_dir() else source
    found = sorted(p for p in base.iterdir() if (p / "trace").is_dir() or (p / "probe").is_dir())
    if not found:
        raise SystemExit(f"no run folders under {base}: run `python -m lightning_par.compare` "
                         "(it keeps each strategy's probes and traces in runs/)")  # fmt: skip
    return found


def scale_main(args) -> int:
    runs = [load_run(f) for f in _run_folders(Path(args.source))]
    loop = pooled_loopback([r for r in runs if r.traces])
    topo = _topology(args, loop)
    rows, curve, skipped = [], [], []
    for run in runs:
        try:
            prof = profile(run, run.graph(own_link(run, loop)))
        except ValueError as err:
            skipped.append(str(err))
            continue
        rows += [scaling_row(prof, p, topo, args.speedup) for p in args.devices]
        curve += [scaling_row(prof, p, topo, args.speedup) for p in CURVE]
    assumptions = (f"links {topo.name} ({topo.per_node}/node), compute {args.speedup:g}x the "
                   "measured, batch per device fixed (weak scaling)")  # fmt: skip
    figure = scaling_figure(curve, Path(args.out) / "predicted_scaling.png", assumptions)
    if args.json:
        print(json.dumps({"assumptions": assumptions, "rows": rows, "skipped": skipped}))
        return 0
    print(f"PREDICTED (not measured): {assumptions}")
    print(scaling_table(rows))
    for line in skipped:
        print(f"skipped: {line}")
    print(f"curves: {figure}")
    return 0


def replay_main(args) -> int:
    run = load_run(args.replay)
    try:
        own = run.loopback()
    except ValueError:
        own = PRESETS["loopback"]
    topo = _topology(args, own)
    speed = {r: args.speedup * args.rank_speed.get(r, 1.0) for r in range(run.world)}
    result = simulate(run.graph(own), topo, speed, args.contention)
    last = {r: w[-1:] for r, w in run.windows.items()} if run.windows else None
    one = load_run(args.replay)
    one.windows = last
    single = one.graph(own)
    what_if = f"{topo.name}, compute {args.speedup:g}x"
    picture = side_by_side(single, simulate(single, topo, speed, args.contention),
                           Path(args.out) / f"{run.name}_gantt.png", what_if)  # fmt: skip
    doc = {"strategy": run.name, "link": topo.name, "speedup": args.speedup,
           "measured_step_s": run.measured_step_s, "predicted_step_s": result.mean_step_s,
           "split": {r: result.per_step_split(r) for r in result.end},
           "loopback": {"alpha_s": own.alpha, "beta_s_per_byte": own.beta},
           "gantt": str(picture)}  # fmt: skip
    if args.json:
        print(json.dumps(doc))
        return 0
    measured = run.measured_step_s
    print(f"{run.name}: measured step {measured * 1e3:.2f} ms" if measured else run.name)
    print(f"simulated on {what_if}: {result.mean_step_s * 1e3:.2f} ms per step")
    print(split_table(result))
    print(f"gantt: {picture}")
    return 0


def validation(work: str | None, reuse: str | None, rounds: int,
               strategies: tuple[str, ...] = VALIDATED, steps: int = 10) -> dict:  # fmt: skip
    """Every validation row (``strategies`` trained here into ``work`` for ``steps`` steps
    each, or read from a kept ``reuse`` folder), with the machine it was measured on and the
    load."""
    import tempfile

    quiet_lightning()
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="lightning_par-simulate-") as tmp:
        folder = Path(reuse or work or tmp)
        if reuse:
            found = kept_rounds(folder)
        else:
            found = measure(folder, tuple(strategies), rounds=rounds, steps=steps)
        machine = kept_machine(found)
        write_timings = timings.keep_in(folder)  # (a rescoring reads the first one's)
        table = rows(found, machine)
        write_timings()
    return {"rows": table, "load_1m_start": round(load, 2),
            "load_1m_end": round(os.getloadavg()[0], 2), "cores": machine.cores,
            "threads": machine.threads, "sharing_cost": machine.sharing_cost,
            "step_cpu": machine.step_cpu, "unmeasured": list(machine.unmeasured)}  # fmt: skip


def _sharing(cost: dict) -> str:
    if not cost:
        return "no rank takes turns on a core"
    each = ", ".join(f"{p} ranks {c:.2f}x" for p, c in sorted(cost.items()))
    return f"a step's CPU where ranks take turns on the cores: {each}"


def _unmeasured(doc: dict) -> str:
    missing = doc.get("unmeasured") or []
    if not missing:
        return ""
    return (f"\nnot measured, every trial ran beside other processes' load: {', '.join(missing)}"
            " (taken as in proportion to the batch / no cost of taking turns)")  # fmt: skip


def validation_report(doc: dict) -> str:
    return (
        f"measured on {doc['cores']} cores, {doc['threads']} thread(s) per rank, "
        f"{_sharing(doc.get('sharing_cost') or {})}, load "
        f"{doc['load_1m_start']} -> {doc['load_1m_end']}{_unmeasured(doc)}\n\n"
        f"{validation_table(doc['rows'])}\n\nWhat the scale rows started from (each "
        "strategy's 2-worker rounds; compute is CPU time, each traced span its best round, "
        "messages priced by the fastest quarter of their transfers):\n\n"
        f"{base_table(doc['rows'])}"
    )


def validate_main(args) -> int:
    doc = validation(args.work, args.reuse, args.rounds, tuple(args.strategies))
    print(json.dumps(doc) if args.json else validation_report(doc))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    try:
        if args.validate:
            return validate_main(args)
        if args.replay:
            return replay_main(args)
        return scale_main(args)
    except ValueError as err:  # no traces, no probes, a strategy without a model: say so
        print(f"python -m lightning_par.simulate: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    exit_on_sigterm()  # (its temporary folders go on kill or timeout, as on Ctrl-C)
    sys.exit(main())
