"""``python -m lightning_par.compare``: every registered strategy on one model, one report.

Trains the model for ``--steps`` steps at one global batch under each strategy of
:func:`lightning_par.strategies.registry.strategy_specs` (a strategy added there is compared
without a change here), then writes ``report.md`` and PNG figures to ``--out`` (default
``runs/compare/``); ``--json`` prints the report as one JSON document instead of the table.
``--strategies`` takes registered names, each with options of its own if wanted
(``zero:stage=1 zero:stage=2 zero``: one row each).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import sys
import tempfile
from pathlib import Path

from lightning_par.cli_help import DefaultsFormatter, plain
from lightning_par.compare import report
from lightning_par.compare.predicted import predicted_section
from lightning_par.compare.rows import build_row, combine
from lightning_par.launch.processes import exit_on_sigterm
from lightning_par.measure.run import MODELS, describe_model, run_all
from lightning_par.quiet import quiet_lightning
from lightning_par.strategies.registry import parse_choice, spec, strategy_specs

#: Devices a strategy needs other than ``--devices`` (a strategy class may say so itself with
#: a ``compare_devices`` class attribute, which wins). Names not here use ``--devices``.
DEVICE_HINTS = {"hybrid": 4}


def devices_for(name: str, cls: type, default: int) -> int:
    own = getattr(cls, "compare_devices", None)
    return int(own) if isinstance(own, int) else DEVICE_HINTS.get(name, default)


def folder_name(label: str) -> str:
    """A row's label as a folder name (``zero:stage=1`` -> ``zero-stage=1``)."""
    return re.sub(r"[^A-Za-z0-9_.=-]", "-", label)


def _check_choice(text: str, known: list[str]) -> str | None:
    """Why ``--strategies`` cannot take ``text`` (``None``: it can)."""
    try:
        name, options = parse_choice(text)
    except ValueError as err:
        return str(err)
    if name not in known:
        return f"unknown strategies [{name!r}]; registered: {', '.join(known)}"
    try:
        if options:
            spec(name).create(**options)  # the strategy checks its own options
    except (TypeError, ValueError) as err:
        return f"{text}: {err}"
    return None


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_par.compare",
        description=plain(__doc__ or ""),
        formatter_class=DefaultsFormatter,
    )
    parser.add_argument(
        "--strategies",
        nargs="+",
        metavar="NAME[:KEY=VALUE,...]",
        help="default: every registered strategy, with its own options",
    )
    parser.add_argument("--model", default="CifarCNN", choices=MODELS)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=4, help="first steps left out of times")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved runs per strategy")
    parser.add_argument("--devices", type=int, default=2, help="workers per strategy")
    parser.add_argument("--batch-size", type=int, default=64, help="global batch per step")
    parser.add_argument("--accelerator", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--data", default="cifar10-mini", choices=("cifar10-mini", "synthetic"))
    parser.add_argument("--out", default="runs/compare", help="folder of report.md and PNGs")
    parser.add_argument("--timeout", type=float, default=180, help="seconds per strategy")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    known = [s.name for s in strategy_specs()]
    for text in args.strategies or []:
        if (why := _check_choice(text, known)) is not None:
            parser.error(why)
    if args.steps <= args.warmup:
        parser.error(f"--steps ({args.steps}) must be larger than --warmup ({args.warmup})")
    if min(args.devices, args.batch_size, args.rounds) < 1:
        parser.error("--devices, --batch-size and --rounds must be >= 1")
    if args.batch_size % args.devices:
        parser.error(f"--batch-size {args.batch_size} must split evenly over {args.devices} "
                     "workers (each data-parallel rank reads an equal share)")  # fmt: skip
    if args.data == "cifar10-mini":
        from lightning_par.data.sources import find_cifar10_mini  # slow: loads torchvision

        if find_cifar10_mini() is None:
            parser.error("cifar10-mini not found (see the README's data section); or run "
                         "with --data synthetic")  # fmt: skip
    if args.accelerator == "cuda":
        import torch

        if torch.cuda.device_count() < args.devices:
            parser.error(f"--accelerator cuda needs {args.devices} GPUs, found "
                         f"{torch.cuda.device_count()}")  # fmt: skip
    return args


def plan(args: argparse.Namespace, work: Path) -> list[dict]:
    """The runs, one per strategy (``strategy``: its label as typed; ``name``, ``options``:
    the registered name and the options it adds) and round."""
    chosen = args.strategies or [s.name for s in strategy_specs()]
    rows = []
    for round_ in range(args.rounds):  # interleaved: every strategy once per round
        for label in dict.fromkeys(chosen):
            name, options = parse_choice(label)
            rows.append({
                "index": len(rows), "round": round_, "strategy": label, "name": name,
                "options": options, "model": args.model, "accelerator": args.accelerator,
                "steps": args.steps, "source": args.data,
                "devices": devices_for(name, spec(name).load(), args.devices),
                "global_batch": args.batch_size,
                "folder": str(work / f"{round_}-{folder_name(label)}"),
            })  # fmt: skip
    return rows


def keep_runs(rows: list[dict], built: list[dict], dest: Path, warmup: int) -> None:
    """Copy each strategy's reported round (probes and traces) to ``dest/<strategy>/``: the
    inputs of ``python -m lightning_par.simulate --from`` (the rest of the work folder goes)."""
    import shutil

    reported = {(r["strategy"], r["round"]) for r in built if r["status"] == "ok"}
    for row in rows:
        folder = Path(row["folder"])
        if (row["strategy"], row["round"]) in reported and folder.is_dir():
            target = dest / folder_name(row["strategy"])
            shutil.rmtree(target, ignore_errors=True)
            shutil.copytree(folder, target)
            (target / "row.json").write_text(json.dumps({**row, "warmup": warmup}))


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)

    quiet_lightning()
    machine = report.machine_info(args.accelerator)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="lightning_par-compare-") as tmp:
        rows = plan(args, Path(tmp))
        if not args.json:
            print(f"comparing {len(rows) // args.rounds} strategies on {args.model}, "
                  f"{args.steps} steps, {args.rounds} rounds ...", flush=True)  # fmt: skip
        results = run_all(rows, args.timeout)
        built = combine([build_row(r, results[r["index"]], args.warmup) for r in rows])
        keep_runs(rows, built, out / "runs", args.warmup)
    machine["load_1m_end"] = round(os.getloadavg()[0], 2)
    settings = {"model": args.model, "model_spec": describe_model(args.model),
                "steps": args.steps, "warmup": args.warmup,
                "devices": args.devices, "global_batch": args.batch_size, "rounds": args.rounds,
                "accelerator": args.accelerator, "data": args.data}  # fmt: skip
    command = "python -m lightning_par.compare " + shlex.join(argv if argv is not None
                                                              else sys.argv[1:])  # fmt: skip
    doc = {"command": command.strip(), "machine": machine, "settings": settings, "rows": built}
    pictures = report.figures(built, out)

    (out / "report.md").write_text(report.markdown(doc, pictures, predicted_section(out)))
    (out / "report.json").write_text(json.dumps(doc, indent=1))
    if args.json:
        print(json.dumps(doc))
    else:
        print(report.table(built))
        print(f"report: {out / 'report.md'}")
    return 0 if all(r["status"] == "ok" for r in built) else 1


if __name__ == "__main__":
    exit_on_sigterm()  # (its temporary folders go on kill or timeout, as on Ctrl-C)
    sys.exit(main())
