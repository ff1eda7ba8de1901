"""Every benchmark and every registered strategy, at their smallest, on this interpreter's torch
(``make smoke-old-torch`` runs it in ``.venv-torch213``: a torch we claim is one we ran).

    python -m tests.smoke.run [--only benchmarks|strategies] [--skip simulate] [--timeout 300]

Each benchmark runs its ``main`` at its smallest settings (:data:`SMALLEST`, ``--json``), one
after the other in this process (what ``python -m lightning_par.bench NAME`` runs, without
paying the start-up per benchmark), and must print its JSON with the environment it ran on;
then ``python -m lightning_par.check`` trains every registered
strategy for two steps on 2 CPU processes. Prints the environment line and a Markdown table
(what, ok / failed / not run, seconds, the first line of a failure); exit code 1 if anything
failed. Without a working torchvision (the old-torch venv has none: the index's torchvision
0.28.0 is a CUDA build whose operators do not load beside torch 2.13.0+cpu), what needs it
is "not run", with that reason.
"""

from __future__ import annotations

import argparse
import importlib
import io
import json
import os
import sys
import time
from contextlib import redirect_stdout

from lightning_par.bench.__main__ import available
from lightning_par.bench._environment import RunEnvironment, environment_line
from lightning_par.launch.processes import run_bounded, time_limit
from lightning_par.quiet import quiet_report

#: Each benchmark's smallest run (the data benchmarks read cifar10-mini).
SMALLEST: dict[str, list[str]] = {
    "allreduce": ["--world-size", "2", "--sizes", "10", "--repeats", "1", "--warmup", "1"],
    "async": ["--epochs", "1", "--limit-batches", "2", "--seeds", "0",
              "--strategies", "async_sgd", "--width", "4"],
    "data": ["--steps", "3", "--warmup", "1", "--rounds", "1", "--width", "4",
             "--num-blocks", "1", "--batch-size", "8"],
    "faults": ["--strategies", "ring_allreduce", "--worlds", "2", "--steps", "8",
               "--fault-step", "4", "--checkpoint-every", "2", "--width", "4", "--num-blocks", "1",
               "--batch-size", "4"],
    "layerwise": ["--time-chunks", "32", "--steps", "1", "--rounds", "1", "--warmup", "0"],
    "local_sgd": ["--epochs", "1", "--limit-batches", "2", "--slowdowns", "1", "--width", "4",
                  "--num-blocks", "1"],
    "parameter_server": ["--rounds", "1", "--steps", "3", "--warmup", "1", "--width", "32",
                         "--batch", "4", "--strategies", "parameter_server(S=1)"],
    "parity": ["--steps", "6", "--plugins", "ring_allreduce", "lightning_ddp"],
    "pipeline": ["--workload", "linear", "--chunks", "2", "--steps", "1", "--rounds", "1",
                 "--warmup", "0", "--single-threads", "1"],
    "pipeline_memory": ["--stages", "2"],
    "simulate": ["--rounds", "1", "--strategies", "ring_allreduce", "--steps", "6"],
    "strategy": ["--steps", "3", "--warmup", "1", "--width", "4", "--num-blocks", "1",
                 "--batch-size", "4", "--algorithms", "ring"],
    "tensor_parallel": ["--world", "2", "--dim", "8", "--hidden", "16", "--tokens", "4",
                        "--steps", "1", "--rounds", "1", "--warmup", "0"],
    "zero": ["--world-sizes", "2", "--models", "mlp", "--steps", "1", "--warmup", "1",
             "--rounds", "1", "--mlp-width", "32", "--mlp-depth", "1"],
}  # fmt: skip
#: What needs torchvision (torchvision's ResNet-18).
NEEDS_TORCHVISION = ("pipeline_memory",)


def torchvision_error() -> str | None:
    """Why torchvision cannot be used here, or ``None`` when it imports."""
    try:
        import torchvision  # noqa: F401  (optional: only what needs it is left out)
    except Exception as err:  # an ImportError, or a build that does not load beside this torch
        return f"torchvision does not import here ({type(err).__name__}: {err})".splitlines()[0]
    return None


def _first_problem(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    errors = [ln for ln in lines if "Error" in ln or "error" in ln]
    return ((errors or lines or ["no output"])[-1]).strip()[:200]


def run_benchmark(name: str, timeout: float) -> dict:
    """One benchmark at its smallest, in this process (its ranks start through a forkserver,
    as ``python -m lightning_par.check`` starts its rows'); its JSON must name the torch."""
    out = io.StringIO()
    start = time.perf_counter()
    try:
        with time_limit(timeout, f"timed out after {timeout:.0f} s"), redirect_stdout(out):
            module = importlib.import_module(f"lightning_par.bench.{name}")
            code = module.main([*SMALLEST[name], "--json"])
    except BaseException as err:  # noqa: BLE001 - the row says what failed (argparse exits too)
        code, error = 1, f"{type(err).__name__}: {err}".splitlines()[0][:200]
    else:
        error = None if code in (0, None) else f"exit code {code}"
    row = {"what": f"bench {name}", "seconds": round(time.perf_counter() - start, 1)}
    if error is not None:
        return {**row, "status": "failed", "error": error}
    try:
        doc = _json_in(out.getvalue(), "{")
        assert doc["environment"]["torch"]
    except (ValueError, KeyError, AssertionError):
        return {**row, "status": "failed", "error": "no JSON with its environment on stdout"}
    failed = [r for r in _rows(doc) if "failed" in r]
    return {**row, "status": "ok", "peers_failed": [json.dumps(r) for r in failed]}


def _json_in(text: str, opening: str):
    """The JSON document that starts at the first ``opening`` of ``text``."""
    return json.JSONDecoder().raw_decode(text[text.index(opening) :])[0]


def _rows(doc: dict) -> list[dict]:
    if "workloads" in doc:
        return [r for w in doc["workloads"] for r in w["rows"]]
    return list(doc.get("rows", []))


def run_strategies(timeout: float) -> list[dict]:
    """Every registered strategy, two steps of the CIFAR CNN on 2 CPU processes."""
    cmd = [sys.executable, "-m", "lightning_par.check", "--accelerators", "cpu", "--models",
           "CifarCNN", "--steps", "2", "--timeout", str(timeout), "--json"]  # fmt: skip
    start = time.perf_counter()
    done = run_bounded(cmd, timeout * 20)
    try:
        checked = _json_in(done.stdout, "[")
    except ValueError:
        seconds = round(time.perf_counter() - start, 1)
        error = _first_problem(done.stderr or done.stdout)
        return [{"what": "strategies", "status": "failed", "seconds": seconds, "error": error}]
    return [{"what": f"strategy {r['strategy']} ({r['processes']} processes)",
             "status": r["status"], "seconds": r.get("seconds"),
             **({"error": r["error"]} if "error" in r else {})} for r in checked]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("benchmarks", "strategies"))
    parser.add_argument("--skip", nargs="*", default=[], choices=sorted(SMALLEST),
                        help="benchmarks not to run (shown as skipped)")  # fmt: skip
    parser.add_argument("--timeout", type=float, default=300, help="seconds per run")
    args = parser.parse_args(argv)
    quiet_report()
    # ranks of fits started here start clean through a forkserver: a script's ranks would
    # run this whole script again (as python -m lightning_par.check does for its rows)
    os.environ.setdefault("LIGHTNING_PAR_START_METHOD", "forkserver")
    started = RunEnvironment.now()
    missing = torchvision_error()
    rows = []
    start = time.perf_counter()
    if args.only != "strategies":
        for name in available():
            if name not in SMALLEST:  # (malloc: a helper module, not a benchmark)
                continue
            if name in args.skip:
                rows.append({"what": f"bench {name}", "status": "skipped", "error": "--skip"})
            elif name in NEEDS_TORCHVISION and missing:
                rows.append({"what": f"bench {name}", "status": "not run", "error": missing})
            else:
                rows.append(run_benchmark(name, args.timeout))
            print(_line(rows[-1]), file=sys.stderr, flush=True)
    if args.only != "benchmarks":
        rows += run_strategies(args.timeout)
    print(environment_line(started.finished()))
    print(f"smoke run: {time.perf_counter() - start:.0f} s\n")
    print("| what | status | seconds | note |\n|---|---|---|---|")
    print("\n".join(_line(r) for r in rows))
    return 1 if any(r["status"] == "failed" for r in rows) else 0


def _line(row: dict) -> str:
    note = row.get("error") or "; ".join(row.get("peers_failed", [])) or ""
    return f"| {row['what']} | {row['status']} | {row.get('seconds', '-')} | {note} |"


if __name__ == "__main__":
    sys.exit(main())
