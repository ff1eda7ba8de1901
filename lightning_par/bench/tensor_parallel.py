"""Tensor-parallel benchmark: our column/row MLP against torch's DTensor tensor parallelism.

``python -m lightning_par.bench tensor_parallel [--world 2] [--dim 512] [--hidden 2048]
[--tokens 256] [--rounds 5] [--json]``

One Megatron MLP block, ``Linear(dim, hidden) -> GELU -> Linear(hidden, dim)``, trains with
SGD on ``tokens`` rows (the input needs a gradient, as inside a deeper network, so the
backward ``f`` runs too). The ranks start once (gloo, one thread each) and every round
runs each variant for ``--steps`` steps, in alternating order, so that load from elsewhere
hits all alike; figures are medians over rounds of the slowest rank's time per step, and the
ratio is the median of the per-round ratios:

* ``ours``: :func:`lightning_par.tensorparallel.parallelize` with ``{"0": "column",
  "2": "row"}``; ``f`` and ``g`` are our ring allreduce over point-to-point messages;
* ``torch DTensor``: ``parallelize_module`` with ``ColwiseParallel`` / ``RowwiseParallel``
  (functional collectives on gloo's own allreduce);
* ``one process``: rank 0 trains the whole block alone (the others wait): when does
  cutting pay on this machine?

and, to explain the gap, one allreduce of the block's activations (the size of each ``f``
and ``g``) by our ring and by gloo's own ``all_reduce``.

Bytes: ours are each rank's traced sends per step, next to the cost model's prediction
(:func:`lightning_par.tensorparallel.cost.step_cost`). torch's collectives are counted by a
dispatch mode (kind and payload); gloo does not report what it sends, so its wire bytes are
given as a ring's (the payload times ``2 (p - 1) / p``), an estimate. The outputs of the
first forward of both are compared.

torch's two (DTensor, gloo's allreduce) each run on a gloo group of their own; one that
fails is a row ``{"variant", "failed"}``, and ours are still measured (:mod:`._peers`).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_par.bench._environment import RunEnvironment, print_result
from lightning_par.bench._peers import PeerGuard, run_with_peers
from lightning_par.collectives import ring_allreduce
from lightning_par.collectives.cost_model import predict
from lightning_par.comm import CommTrace, Communicator
from lightning_par.tensorparallel import TPGroup, parallelize, resolve_plan
from lightning_par.tensorparallel.cost import step_cost

PLAN = {"0": "column", "2": "row"}
VARIANTS = ("ours", "torch DTensor", "one process")
#: torch's variants: each on a group of its own, a failure a row
PEERS = ("torch DTensor", "gloo allreduce")


def block(dim: int, hidden: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))


def batch(dim: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(tokens, dim, generator=g), torch.randn(tokens, dim, generator=g)


class CountCollectives(TorchDispatchMode):
    """Records ``(collective, payload elements)`` of every functional collective dispatched."""

    KINDS = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all")

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in self.KINDS and isinstance(args[0], torch.Tensor):
            self.calls.append((name, args[0].numel()))
        return func(*args, **(kwargs or {}))


def torch_tp(net: nn.Module, group: dist.ProcessGroup) -> nn.Module:
    """``net`` cut by torch's tensor parallelism over the ranks of ``group``."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = DeviceMesh.from_group(group, "cpu")
    return parallelize_module(net, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})


def _torch_first_step(dim: int, hidden: int, x, target, ours_out, group) -> tuple:
    """torch's block, its first forward's largest difference to ours and the collectives of
    its first step (counted)."""
    theirs = torch_tp(block(dim, hidden), group)
    with torch.no_grad():  # DTensor's output is a plain local tensor
        diff = (ours_out - theirs(x)).abs().max().item()
    with CountCollectives() as counted:
        _step(theirs, torch.optim.SGD(theirs.parameters(), lr=1e-3), x, target)
    return theirs, diff, counted.calls


def _step(net: nn.Module, opt: torch.optim.Optimizer, x, target) -> torch.Tensor:
    opt.zero_grad()
    y = net(x.detach().requires_grad_())
    nn.functional.mse_loss(y, target).backward()
    opt.step()
    return y


def _ranks(rank: int, world: int, dim: int, hidden: int, tokens: int, warmup: int, steps: int,
           rounds: int, *, guard: PeerGuard) -> dict:  # fmt: skip
    x, target = batch(dim, tokens)
    trace = CommTrace(rank)
    ours = copy.deepcopy(block(dim, hidden))
    parallelize(ours, TPGroup(Communicator(trace=trace)), PLAN)
    with torch.no_grad():
        ours_out = ours(x)
    groups = {name: guard.group(name) for name in PEERS}
    built = guard.run(
        "torch DTensor",
        lambda: _torch_first_step(dim, hidden, x, target, ours_out, groups["torch DTensor"]),
    )
    models = {"ours": ours, **({} if built is None else {"torch DTensor": built[0]}),
              "one process": block(dim, hidden)}  # fmt: skip
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, m in models.items()}
    trace.clear()
    _step(ours, opts["ours"], x, target)
    ours_bytes, ours_messages = trace.bytes_sent, trace.messages_sent
    payload = torch.randn(tokens, dim)  # one f or g: our ring against gloo's own allreduce
    comm = Communicator()
    work = {**{k: lambda k=k: _step(models[k], opts[k], x, target) for k in models},
            "ring allreduce": lambda: ring_allreduce(payload, comm=comm),
            "gloo allreduce": lambda: dist.all_reduce(payload, group=groups["gloo allreduce"]),
            }  # fmt: skip
    seconds: dict[str, list[float]] = {k: [] for k in work}
    for r in range(warmup + rounds):
        order = list(work) if r % 2 == 0 else list(work)[::-1]
        for name in order:
            dist.barrier()
            if name in PEERS:
                elapsed = guard.run(name, lambda w=work[name]: _run_variant(w, steps))
            elif name == "one process" and rank != 0:
                elapsed = 0.0  # (rank 0 trains alone; the others wait)
            else:
                elapsed = _run_variant(work[name], steps)
            dist.barrier()
            if r >= warmup and elapsed is not None:
                seconds[name].append(elapsed)
    for name in guard.failed:
        seconds.pop(name, None)
    return {"seconds": seconds, "diff": None if built is None else built[1],
            "bytes": ours_bytes, "messages": ours_messages,
            "torch_calls": None if built is None else built[2]}  # fmt: skip


def _run_variant(work, steps: int) -> float:
    """Seconds per step of ``steps`` calls of ``work``."""
    start = time.perf_counter()
    for _ in range(steps):
        work()
    return (time.perf_counter() - start) / steps


def _torch_row(per_round: dict, calls: list[tuple[str, int]], world: int) -> dict:
    ring_estimate = sum(predict("ring", n, world).bytes_sent[0] for _, n in calls)
    return {"variant": "torch DTensor", "step_s": statistics.median(per_round["torch DTensor"]),
            "ratio_vs_torch": 1.0, "collectives_per_step": len(calls),
            "collectives": sorted({name for name, _ in calls}),
            "payload_bytes_per_step": sum(n for _, n in calls) * 4,
            "ring_estimate_bytes_per_step": ring_estimate}  # fmt: skip


def run(world: int, dim: int, hidden: int, tokens: int, warmup: int, steps: int,
        rounds: int) -> dict:  # fmt: skip
    results, failed = run_with_peers(_ranks, world, dim, hidden, tokens, warmup, steps, rounds,
                                     timeout=1200)  # fmt: skip
    per_round = {  # the slowest rank of each round (one process: rank 0 alone)
        name: [max(rs) for rs in zip(*(r["seconds"][name] for r in results))]
        if name != "one process" else results[0]["seconds"][name]
        for name in results[0]["seconds"]
    }  # fmt: skip
    x, _ = batch(dim, tokens)
    net = block(dim, hidden)
    cost = step_cost(net, resolve_plan(net, world, PLAN), x.requires_grad_())

    def ratio(a: str) -> float | None:  # a's time over torch's, the median of the rounds'
        if "torch DTensor" not in per_round:
            return None
        return statistics.median(p / q for p, q in zip(per_round[a], per_round["torch DTensor"]))

    torch_row = ({"variant": "torch DTensor", "failed": failed["torch DTensor"]}
                 if "torch DTensor" in failed
                 else _torch_row(per_round, results[0]["torch_calls"], world))  # fmt: skip
    rows = [
        {"variant": "ours", "step_s": statistics.median(per_round["ours"]),
         "ratio_vs_torch": ratio("ours"),
         "bytes_sent_per_step": [r["bytes"] for r in results],
         "predicted_bytes_per_step": list(cost.bytes_sent),
         "messages_per_step": [r["messages"] for r in results],
         "collectives_per_step": 2, "payload_bytes_per_step": 2 * tokens * dim * 4},
        torch_row,
        {"variant": "one process", "step_s": statistics.median(per_round["one process"]),
         "ratio_vs_torch": ratio("one process")},
    ]  # fmt: skip
    gloo = per_round.get("gloo allreduce")
    diffs = [r["diff"] for r in results if r["diff"] is not None]
    return {"bench": "tensor_parallel", "world_size": world, "backend": "gloo",
            "workload": f"Linear({dim},{hidden})-GELU-Linear({hidden},{dim}), {tokens} rows, SGD",
            "rounds": rounds, "steps_per_round": steps,
            "max_abs_output_diff": max(diffs) if diffs else None, "rows": rows,
            "allreduce_payload_bytes": tokens * dim * 4,
            "ring_allreduce_s": statistics.median(per_round["ring allreduce"]),
            "gloo_allreduce_s": statistics.median(gloo) if gloo else None,
            "failed": failed}  # fmt: skip


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f} ms"


def report(result: dict) -> str:
    diff = result["max_abs_output_diff"]
    lines = [f"{result['workload']}, {result['world_size']} ranks on gloo; medians of "
             f"{result['rounds']} interleaved rounds of {result['steps_per_round']} steps; "
             f"first forward: max |ours - DTensor| = {'-' if diff is None else f'{diff:.2e}'}",
             f"{'variant':<15}{'ms/step':>9}{'vs torch':>10}{'collectives':>13}"
             f"{'payload B':>11}{'sent B/rank':>13}{'model B':>10}"]  # fmt: skip
    for r in result["rows"]:
        if "failed" in r:
            lines.append(f"{r['variant']:<15} failed: {r['failed']}")
            continue
        sent = r.get("bytes_sent_per_step", [r.get("ring_estimate_bytes_per_step", "")])[0]
        model = r.get("predicted_bytes_per_step", [""])[0]
        ratio = "-" if r["ratio_vs_torch"] is None else f"{r['ratio_vs_torch']:.2f}x"
        lines.append(f"{r['variant']:<15}{r['step_s'] * 1e3:>9.1f}{ratio:>10}"
                     f"{r.get('collectives_per_step', ''):>13}"
                     f"{r.get('payload_bytes_per_step', ''):>11}{sent:>13}{model:>10}")  # fmt: skip
    lines.append("(sent B/rank: ours traced on rank 0; torch's a ring's estimate from its "
                 "payload, gloo does not report it; model: our cost model)")  # fmt: skip
    gloo = result["failed"].get("gloo allreduce")
    lines.append(f"one allreduce of {result['allreduce_payload_bytes']} B (an f or a g): our "
                 f"ring {_ms(result['ring_allreduce_s'])}, gloo's "
                 f"{'failed: ' + gloo if gloo else _ms(result['gloo_allreduce_s'])}")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_par.bench tensor_parallel")
    parser.add_argument("--world", type=int, default=2, help="ranks the block is cut over")
    parser.add_argument("--dim", type=int, default=512, help="the block's input/output width")
    parser.add_argument("--hidden", type=int, default=2048, help="the hidden width (split)")
    parser.add_argument("--tokens", type=int, default=256, help="rows per batch")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per variant a round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds (medians over them)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    if args.world < 2 or args.hidden % args.world:
        # (ours splits unevenly too; torch's RowwiseParallel fails on an uneven split here)
        parser.error("need --world >= 2 and --hidden a multiple of --world")
    started = RunEnvironment.now()
    result = run(args.world, args.dim, args.hidden, args.tokens, args.warmup, args.steps,
                 args.rounds)  # fmt: skip
    print_result(result, report, args.json, started, indent=2)
    return 0
