"""Layer-wise benchmark: one process, the naive layer split and the RNN wavefront.

``python -m lightning_par.bench layerwise [--time-chunks 16,8,4,2] [--json]``

A stacked LSTM (2 layers, one per stage, K = 2 processes, gloo, one thread each) trains on
one batch; in one run: one process on the whole model, the naive split (``time_chunk=None``:
stage 1 waits for stage 0's whole sequence) and the wavefront at several ``time_chunk``.
Each row gives the step time (best round), the speedup over the naive split and the
measured utilisation (1 - idle share of the last step, from the trace) next to the ideal
``T / (T + K - 1)`` for ``T`` chunks. Then per-stage parameter bytes of the CIFAR CNN and
RNN under K = 2 as the partition predicts them, and the bytes the RNN stages held.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch import nn

from lightning_par.comm import CommTrace, Communicator, run_on_ranks
from lightning_par.modelparallel import (
    WavefrontSequential,
    stacked_rnn,
    time_chunk_sizes,
    train_step,
    wavefront_balance,
    wavefront_utilisation,
)
from lightning_par.modelparallel.memory import predicted_param_bytes, stage_memory
from lightning_par.pipeline.partition import balance_by_params
from lightning_par.pipeline.timeline import measured_bubble

BATCH, SEQ, FEATURES, HIDDEN, LAYERS = 32, 64, 64, 256, 2


class LastStep(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(HIDDEN, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x[:, -1])


def workload() -> tuple[nn.Sequential, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    net = stacked_rnn("lstm", [FEATURES] + [HIDDEN] * LAYERS)
    net.append(LastStep())
    return net, torch.randn(BATCH, SEQ, FEATURES), torch.randint(0, 10, (BATCH,))


def _timed(step, warmup: int, steps: int, rounds: int) -> float:
    for _ in range(warmup):
        step()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(steps):
            step()
        best = min(best, (time.perf_counter() - start) / steps)
    return best


def _single(rank, world, warmup, steps, rounds):
    torch.set_num_threads(1)
    net, x, y = workload()
    opt = torch.optim.SGD(net.parameters(), lr=0.01)

    def step():
        opt.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()

    return _timed(step, warmup, steps, rounds)


def _stages(rank, world, time_chunk, warmup, steps, rounds):
    torch.set_num_threads(1)
    net, x, y = workload()
    comm = Communicator(trace=CommTrace(rank=rank))
    piped = WavefrontSequential(net, wavefront_balance(net, world), comm, time_chunk)
    piped.runtime.measure_memory()
    opt = torch.optim.SGD(piped.parameters(), lr=0.01, momentum=0.9)

    def step():
        opt.zero_grad()
        train_step(piped, x, y, nn.functional.cross_entropy)
        opt.step()

    seconds = _timed(step, warmup, steps, rounds)
    memory = stage_memory(piped, opt, piped.runtime.saved.nbytes)
    return seconds, comm.trace, memory


def run(time_chunks: list[int | None], warmup: int, steps: int, rounds: int) -> dict:
    stages = 2
    single = run_on_ranks(_single, 1, warmup, steps, rounds, timeout=900)[0]
    rows, naive = [], None
    for tc in [None, *time_chunks]:
        results = run_on_ranks(_stages, stages, tc, warmup, steps, rounds, timeout=900)
        seconds = max(r[0] for r in results)
        traces = [r[1] for r in results]
        last = warmup + rounds * steps - 1
        chunks = len(time_chunk_sizes(SEQ, tc))
        naive = seconds if tc is None else naive
        rows.append({
            "variant": "naive split" if tc is None else "wavefront",
            "time_chunk": tc or SEQ, "chunks": chunks, "step_s": seconds,
            "speedup_over_naive": naive / seconds,
            "speedup_over_one_process": single / seconds,
            "utilisation_measured": 1.0 - measured_bubble(traces, last),
            "utilisation_theory": wavefront_utilisation(stages, chunks),
            "memory": [r[2] for r in results],
        })  # fmt: skip
    from lightning_par.models import CifarCNN, CifarRNN

    torch.manual_seed(0)
    cnn, rnn = CifarCNN().net, CifarRNN().net
    memory = {
        "cnn_param_bytes": predicted_param_bytes(cnn, balance_by_params(cnn, stages)),
        "rnn_param_bytes": predicted_param_bytes(rnn, wavefront_balance(rnn, stages)),
        "cnn_total_bytes": sum(p.numel() * 4 for p in cnn.parameters()),
        "rnn_total_bytes": sum(p.numel() * 4 for p in rnn.parameters()),
    }
    workload_desc = f"LSTM {LAYERS}x{HIDDEN}, batch {BATCH}, {SEQ} steps of {FEATURES}"
    return {"workload": workload_desc, "stages": stages, "one_process_s": single, "rows": rows,
            "cifar_models_k2": memory}  # fmt: skip


def report(result: dict) -> str:
    lines = [f"{result['workload']}, K = {result['stages']}; one process: "
             f"{result['one_process_s'] * 1e3:.1f} ms/step",
             f"{'variant':<12}{'chunk':>6}{'T':>4}{'ms/step':>9}{'vs naive':>9}"
             f"{'util':>7}{'theory':>8}"]  # fmt: skip
    for r in result["rows"]:
        util, theory = r["utilisation_measured"], r["utilisation_theory"]
        lines.append(f"{r['variant']:<12}{r['time_chunk']:>6}{r['chunks']:>4}"
                     f"{r['step_s'] * 1e3:>9.1f}{r['speedup_over_naive']:>8.2f}x"
                     f"{util:>7.0%}{theory:>8.0%}")  # fmt: skip
    m = result["cifar_models_k2"]
    lines.append(f"CNN param bytes per stage {m['cnn_param_bytes']} of {m['cnn_total_bytes']}")
    lines.append(f"RNN param bytes per stage {m['rnn_param_bytes']} of {m['rnn_total_bytes']}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_par.bench layerwise")
    parser.add_argument("--time-chunks", default="16,8,4,2", help="wavefront chunk lengths")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=2, help="rounds; the best one counts")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    chunks = [int(c) for c in args.time_chunks.split(",")]
    result = run(chunks, args.warmup, args.steps, args.rounds)
    print(json.dumps(result, indent=2) if args.json else report(result))
    return 0
