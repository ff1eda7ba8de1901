"""Layer-wise benchmark: one process, the naive layer split and the RNN wavefront.

``python -m lightning_par.bench layerwise [--time-chunks 16,8,4,2] [--rounds 5] [--json]``

A stacked LSTM (2 layers of 256, one per stage, K = 2 processes, gloo, one thread each)
trains on one batch. The two ranks start once and run every variant in each round, one
after the other, so that a burst of load from elsewhere hits all variants alike; each
variant's figure is its best round:

* ``one process``: rank 0 alone runs the whole model (rank 1 waits at a barrier);
* ``1-proc chunked``: rank 0 alone, the sequence cut into ``time_chunk`` steps as the
  wavefront cuts it: the price of small LSTM calls, without any communication;
* ``two at once``: both ranks run the whole model at the same time, without messages:
  how much two busy processes slow each other down on this machine;
* ``naive split`` (``time_chunk=None``: stage 1 waits for stage 0's whole sequence) and the
  ``wavefront`` at each ``time_chunk``.

From the trace of each variant's shortest step: utilisation (busy share of the stages) next
to the ideal ``T / (T + K - 1)``, the compute (forward + backward spans) of each stage per
step and per chunk, the rest of the step (waiting for the other stage, messages, Python),
and the step the schedule would take with those chunk costs and free messages,
``(T + K - 1) x`` the slowest stage's compute per chunk. The input has as many features as
the hidden state, so both stages do the same work (with 64 input features, stage 0 does
about 0.7x stage 1's work and the wavefront is bound by stage 1). Then per-stage bytes.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from torch import nn

from lightning_par.bench._environment import RunEnvironment, print_result
from lightning_par.comm import CommTrace, Communicator, run_on_ranks
from lightning_par.modelparallel import (
    CarriedState,
    WavefrontSequential,
    stacked_rnn,
    time_chunk_sizes,
    train_step,
    wavefront_balance,
    wavefront_utilisation,
)
from lightning_par.modelparallel.memory import predicted_param_bytes, stage_memory
from lightning_par.models import CifarCNN, CifarRNN
from lightning_par.pipeline.partition import balance_by_params
from lightning_par.pipeline.timeline import measured_bubble, step_events, step_window

BATCH, SEQ, FEATURES, HIDDEN, LAYERS, STAGES = 32, 64, 256, 256, 2, 2


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


def _one_process(time_chunk: int | None):
    """A step of the whole model in one process, in chunks of ``time_chunk`` steps (``None``:
    the plain model), backward chunk by chunk in reverse as a wavefront stage runs it."""
    net, x, y = workload()
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    carried = CarriedState(list(net[:LAYERS]))

    def step() -> None:
        opt.zero_grad()
        if time_chunk is None:
            nn.functional.cross_entropy(net(x), y).backward()
        else:
            carried.reset()
            outs = [carried(c) for c in torch.split(x, time_chunk, dim=1)]
            seq = torch.cat([o.detach() for o in outs], dim=1).requires_grad_(True)
            nn.functional.cross_entropy(net[LAYERS](seq), y).backward()
            for out, grad in reversed(list(zip(outs, torch.split(seq.grad, time_chunk, 1)))):
                torch.autograd.backward(out, grad)
        opt.step()

    return step


def _split(rank: int, world: int, time_chunk: int | None):
    net, x, y = workload()
    comm = Communicator(trace=CommTrace(rank=rank))  # one trace per variant
    piped = WavefrontSequential(net, wavefront_balance(net, world), comm, time_chunk)
    opt = torch.optim.SGD(piped.parameters(), lr=0.01, momentum=0.9)

    def step() -> None:
        opt.zero_grad()
        train_step(piped, x, y, nn.functional.cross_entropy)
        opt.step()

    return step, piped, opt, comm.trace


def _ranks(rank, world, time_chunks, warmup, steps, rounds):
    torch.set_num_threads(1)
    variants: dict[str, tuple] = {"one process": (_one_process(None) if rank == 0 else None,)}
    for tc in time_chunks:
        variants[f"1-proc chunked {tc}"] = (_one_process(tc) if rank == 0 else None,)
    variants["two at once"] = (_one_process(None),)  # both ranks, no messages: CPU contention
    variants["naive split"] = _split(rank, world, None)
    for tc in time_chunks:
        variants[f"wavefront {tc}"] = _split(rank, world, tc)
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    cpu: dict[str, float] = {name: float("inf") for name in variants}
    for r in range(warmup + rounds):
        for name, (step, *_) in variants.items():
            dist.barrier()
            start, thread = time.perf_counter(), time.thread_time()
            for _ in range(steps if step is not None else 0):
                step()
            if r >= warmup and step is not None:
                seconds[name].append((time.perf_counter() - start) / steps)
                # this thread's CPU time: what the stage computed, nearly blind to other
                # processes' load (which only stretches the wall clock)
                cpu[name] = min(cpu[name], (time.thread_time() - thread) / steps)
    out = {"seconds": seconds, "cpu": cpu, "traces": {}, "memory": {}}
    for name, (step, *rest) in variants.items():
        if rest:  # a split variant: its trace, then one more step counting activations
            piped, opt, trace = rest
            out["traces"][name] = trace
            piped.runtime.measure_memory()
            step()
            out["memory"][name] = stage_memory(piped, opt, piped.runtime.saved.nbytes)
    return out


def _breakdown(traces: list[CommTrace], steps: list[int], chunks: int) -> dict:
    """Figures of the shortest of ``steps``: utilisation, compute and the rest per stage."""
    windows = {s: step_window(traces, s) for s in steps}
    best = min(steps, key=lambda s: windows[s][1] - windows[s][0])
    window = windows[best][1] - windows[best][0]
    compute = [sum(e.end - e.start for e in step_events(t, best)) for t in traces]
    # the stage-0 "seq_len" message and the shape headers go once per input shape, in the
    # first step: setup, not part of a step's traffic
    setup = ("seq_len", "header")
    messages = [
        [m for m in t.messages if m.step == best and m.op == "send" and m.tag not in setup]
        for t in traces
    ]
    return {
        "window_s": window,
        "utilisation_measured": 1.0 - measured_bubble(traces, best),
        "compute_s": compute,
        "compute_per_chunk_s": [c / chunks for c in compute],
        "other_s": [window - c for c in compute],
        "ideal_s": (chunks + len(traces) - 1) * max(compute) / chunks,
        "messages_sent": [len(m) for m in messages],
        "bytes_sent": [sum(x.nbytes for x in m) for m in messages],
    }


def run(time_chunks: list[int], warmup: int, steps: int, rounds: int) -> dict:
    results = run_on_ranks(_ranks, STAGES, time_chunks, warmup, steps, rounds, timeout=1200)
    best = {}  # per round, the slowest rank that ran the variant; then the best round
    for name in results[0]["seconds"]:
        ranks = [r["seconds"][name] for r in results if r["seconds"][name]]
        best[name] = min(max(rs) for rs in zip(*ranks))
    naive, single = best["naive split"], best["one process"]
    timed = list(range(warmup * steps, (warmup + rounds) * steps))
    rows = []
    for tc in [None, *time_chunks]:
        name = "naive split" if tc is None else f"wavefront {tc}"
        chunks = len(time_chunk_sizes(SEQ, tc))
        row = {
            "variant": name.split()[0] if tc else name, "time_chunk": tc or SEQ,
            "chunks": chunks, "step_s": best[name],
            "one_process_chunked_s": best[f"1-proc chunked {tc}"] if tc else single,
            "speedup_over_naive": naive / best[name],
            "speedup_over_one_process": single / best[name],
            "utilisation_theory": wavefront_utilisation(STAGES, chunks),
            "stage_cpu_s": [r["cpu"][name] for r in results],
            "memory": [r["memory"][name] for r in results],
        }  # fmt: skip
        row.update(_breakdown([r["traces"][name] for r in results], timed, chunks))
        # the step the schedule would take on free cores with these CPU costs: the naive
        # split runs its stages one after the other, the wavefront (T + K - 1) slots of the
        # slowest stage's T chunks (messages free)
        cpu = row["stage_cpu_s"]
        row["cpu_model_step_s"] = (
            sum(cpu) if tc is None else (chunks + STAGES - 1) / chunks * max(cpu)
        )
        rows.append(row)
    for row in rows:
        row["cpu_model_speedup_over_naive"] = rows[0]["cpu_model_step_s"] / row["cpu_model_step_s"]

    torch.manual_seed(0)
    cnn, rnn = CifarCNN().net, CifarRNN().net
    memory = {
        "cnn_param_bytes": predicted_param_bytes(cnn, balance_by_params(cnn, STAGES)),
        "rnn_param_bytes": predicted_param_bytes(rnn, wavefront_balance(rnn, STAGES)),
        "cnn_total_bytes": sum(p.numel() * 4 for p in cnn.parameters()),
        "rnn_total_bytes": sum(p.numel() * 4 for p in rnn.parameters()),
    }
    workload_desc = f"LSTM {LAYERS}x{HIDDEN}, batch {BATCH}, {SEQ} steps of {FEATURES}"
    return {"workload": workload_desc, "stages": STAGES, "one_process_s": single,
            "two_at_once_s": best["two at once"],
            "rounds": rounds, "steps_per_round": steps, "rows": rows,
            "cifar_models_k2": memory}  # fmt: skip


def report(result: dict) -> str:
    lines = [f"{result['workload']}, K = {result['stages']}; one process: "
             f"{result['one_process_s'] * 1e3:.1f} ms/step, two processes at once (no "
             f"messages) {result['two_at_once_s'] * 1e3:.1f} ms/step each; best of "
             f"{result['rounds']} interleaved rounds of {result['steps_per_round']} steps",
             f"{'variant':<12}{'chunk':>6}{'T':>4}{'ms/step':>9}{'vs naive':>9}"
             f"{'util':>6}{'theory':>7}{'1-proc':>8}{'compute/chunk':>15}{'other':>11}"
             f"{'ideal':>7}{'cpu/stage':>11}{'cpu model':>10}"]  # fmt: skip
    for r in result["rows"]:
        per_chunk = "/".join(f"{c * 1e3:.1f}" for c in r["compute_per_chunk_s"])
        other = "/".join(f"{c * 1e3:.0f}" for c in r["other_s"])
        lines.append(f"{r['variant']:<12}{r['time_chunk']:>6}{r['chunks']:>4}"
                     f"{r['step_s'] * 1e3:>9.1f}{r['speedup_over_naive']:>8.2f}x"
                     f"{r['utilisation_measured']:>6.0%}{r['utilisation_theory']:>7.0%}"
                     f"{r['one_process_chunked_s'] * 1e3:>8.1f}{per_chunk:>15}{other:>11}"
                     f"{r['ideal_s'] * 1e3:>7.1f}"
                     f"{'/'.join(f'{c * 1e3:.0f}' for c in r['stage_cpu_s']):>11}"
                     f"{r['cpu_model_speedup_over_naive']:>9.2f}x")  # fmt: skip
    lines.append("(ms; 1-proc: one process cut into the same chunks; compute/chunk and "
                 "other: stage 0/stage 1 in the shortest step; ideal: (T+K-1) x slowest "
                 "compute/chunk; cpu/stage: each stage's CPU time per step; cpu model: the "
                 "speedup over the naive split those CPU times give on free cores)")  # fmt: skip
    m = result["cifar_models_k2"]
    lines.append(f"CNN param bytes per stage {m['cnn_param_bytes']} of {m['cnn_total_bytes']}")
    lines.append(f"RNN param bytes per stage {m['rnn_param_bytes']} of {m['rnn_total_bytes']}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_par.bench layerwise")
    parser.add_argument("--time-chunks", default="16,8,4,2", help="wavefront chunk lengths")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per variant a round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds; the best one counts")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    chunks = [int(c) for c in args.time_chunks.split(",")]
    started = RunEnvironment.now()
    result = run(chunks, args.warmup, args.steps, args.rounds)
    print_result(result, report, args.json, started, indent=2)
    return 0
