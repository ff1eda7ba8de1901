"""The full user-flow grid (``make userflow``): every registered strategy on every network,
under fork and popen, plus torchrun and a Jupyter kernel, each compared with one process.

    python -m tests.userflow.grid [--networks mlp,vit] [--launches fork,popen] [--out DIR]

Prints a Markdown table, one row per strategy and one column per network × launch: ``ok``
with the run's seconds, or the first problem. Exit code 1 if any cell failed.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from lightning_par.strategies.registry import plugin_names
from tests.userflow.run import Case, baselines, compare, run_flow

NETWORKS = ("mlp", "resnet", "vit", "lstm", "transformer")
LAUNCHES = ("fork", "popen", "torchrun", "notebook")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--networks", default=",".join(NETWORKS))
    parser.add_argument("--launches", default=",".join(LAUNCHES))
    parser.add_argument("--strategies", default=",".join([*plugin_names(), "lightning_ddp"]))
    parser.add_argument("--out", default=None, help="keep every run's folder here")
    args = parser.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="userflow-"))
    columns = [(n, la) for la in args.launches.split(",") for n in args.networks.split(",")]
    print("| strategy | " + " | ".join(f"{n} {la}" for n, la in columns) + " |")
    print("|---" * (len(columns) + 1) + "|", flush=True)
    strategies = args.strategies.split(",")
    want = baselines([Case(s, n, la) for s in strategies for n, la in columns], out)
    failed = 0
    for strategy in strategies:
        cells = []
        for network, launch in columns:
            case = Case(strategy, network, launch)
            start = time.perf_counter()
            got, _ = run_flow(case, out / case.name)
            problems = compare(case, got, want[network, case.replicas])
            seconds = time.perf_counter() - start
            failed += bool(problems)
            first = problems[0].splitlines()[0][:90] if problems else ""
            cells.append(f"ok {seconds:.0f} s" if not problems else f"**{first}**")
        print(f"| `{strategy}` | " + " | ".join(cells) + " |", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
