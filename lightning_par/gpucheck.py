"""``make gpu-check``: everything a machine with GPUs can check, in one command and one table.

    python -m lightning_par.gpucheck                     # the GPU check (refused without CUDA)
    python -m lightning_par.gpucheck --accelerator cpu   # the same driver on CPU (CI tests it)

1. the CUDA tests of ``tests/`` (``pytest -k cuda``; GPU only, ``--no-tests`` skips them);
2. every registered strategy on ``CifarCNN`` for a few steps through
   :mod:`lightning_par.check` (each plugin on its own process-group backend: NCCL on GPUs,
   gloo where the plugin needs it, e.g. the parameter servers), and ``zero``'s other stages
   (:data:`EXTRA_ROWS`: the registered ``zero`` is stage 3), beside single-device
   Lightning;
3. one Markdown table: each row's throughput and its ratio to single-device Lightning's
   (> 1: more images per second than one device), then the CUDA tests' summary line.

Without a CUDA device ``--accelerator gpu`` stops at once with "no CUDA device: ..." and
exit status 2 (nothing to check; CI never has a GPU).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

from lightning_par import check

REFUSED = 2
ROOT = Path(__file__).resolve().parents[1]
#: Rows beyond the registered names: a strategy's options that take another code path
#: (ZeRO stage 1 allreduces whole gradients, stage 2 reduce-scatters them; the registered
#: ``zero`` is stage 3, which gathers each layer's weights around its use).
EXTRA_ROWS = ("zero:stage=1", "zero:stage=2")


def cuda_devices() -> int:
    import torch

    return torch.cuda.device_count()  # NVML-based: does not initialise CUDA here


def no_cuda_message() -> str:
    import torch

    return (
        "no CUDA device: `make gpu-check` needs an NVIDIA GPU and a CUDA build of torch "
        f"(torch {torch.__version__}, CUDA {torch.version.cuda or 'none'}; "
        "torch.cuda.device_count() is 0). On a CPU machine, `make check` runs every strategy "
        "on CPU, or run this driver with --accelerator cpu"
    )


def run_cuda_tests(timeout: float) -> str:
    """``pytest -k cuda`` over the repository's tests; its summary line."""
    tests = ROOT / "tests"
    if not tests.is_dir():
        return f"CUDA tests: none found ({tests} is not a directory)"
    cmd = [sys.executable, "-m", "pytest", str(tests), "-k", "cuda", "-q", "-p", "no:randomly"]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"CUDA tests: timed out after {timeout:.0f} s"
    lines = [ln for ln in proc.stdout.splitlines() if re.search(r"\d+ (passed|failed|error)", ln)]
    return f"CUDA tests: {(lines or ['no summary (exit ' + str(proc.returncode) + ')'])[-1]}"


def table(rows: list[dict]) -> list[str]:
    """The Markdown table: the single-device row first, each row's ratio to it."""
    single = {r["model"]: r.get("images_per_s") for r in rows if r["strategy"] == "single"}
    out = [
        "| strategy | model | device | processes | status | images/s | x single device | s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ips, base = r.get("images_per_s", float("nan")), single.get(r["model"])
        known = ips == ips and base is not None and base == base and base > 0
        ratio = f"{ips / base:.2f}" if known and r["status"] == "ok" else "-"
        shown = f"{ips:.1f}" if ips == ips else "-"
        out.append(
            f"| {r['strategy']} | {r['model']} | {r['device']} | {r['processes']} | "
            f"{r['status']} | {shown} | {ratio} | {r.get('seconds', '-')} |"
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--accelerator", choices=["gpu", "cpu"], default="gpu")
    parser.add_argument(
        "--strategies",
        nargs="*",
        metavar="NAME[:KEY=VALUE,...]",
        help="default: every registered strategy, then " + " ".join(EXTRA_ROWS),
    )
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--timeout", type=float, default=300, help="seconds per row")
    parser.add_argument("--no-tests", action="store_true", help="skip the CUDA tests")
    args = parser.parse_args(argv)
    if args.accelerator == "gpu" and cuda_devices() == 0:
        print(no_cuda_message(), file=sys.stderr)
        return REFUSED

    accel = "cuda" if args.accelerator == "gpu" else "cpu"
    tests = None
    if accel == "cuda" and not args.no_tests:
        tests = run_cuda_tests(timeout=1200)
    strategies = args.strategies or [*check.registered_strategies(), *EXTRA_ROWS]
    rows = check.check_group(check.plan(strategies, ["CifarCNN"], [accel]), args.steps,
                             args.timeout)  # fmt: skip
    print("\n".join(table(rows)))
    if tests is not None:
        print(tests)
    failed = [r for r in rows if r["status"] == "failed"]
    for r in rows:
        if r["status"] != "ok":  # failed, or not run (too few devices here), with the reason
            print(f"{r['status'].upper()} {r['strategy']} {r['device']}: {r.get('error')}")
    bad_tests = tests is not None and re.search(r"\d+ (failed|error)", tests) is not None
    return 1 if failed or bad_tests else 0


if __name__ == "__main__":
    sys.exit(main())
