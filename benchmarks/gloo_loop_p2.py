"""How close can any Python ring over torch's point-to-point calls get to gloo? (p = 2)

    python benchmarks/gloo_loop_p2.py --sizes 1048576 4194304 16777216 --repeats 100 [--json]

Times, interleaved in one run: gloo's own ``dist.all_reduce``, our ``ring_allreduce`` and
``gloo_loop``: the loop of gloo's ring (``gloo/allreduce.cc``: segments of at most
``--segment-bytes``, at least two per rank, receive ``i`` posted just before send ``i``,
the segment received two iterations ago reduced while the next one arrives) written
directly over ``ProcessGroup.send``/``recv``, with no tracing, no Communicator and no
bookkeeping. It moves the same bytes in the same order as gloo, so what separates it from
``dist.all_reduce`` is the Python side of each message, not the algorithm: the ceiling of
any collective written in Python on this transport. Kept for ``benchmarks/allreduce.md``.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist

from lightning_par.bench.allreduce import _time_interleaved
from lightning_par.collectives.ring import ring_allreduce
from lightning_par.comm import run_on_ranks


def gloo_loop(tensor: torch.Tensor, segment_bytes: int = 1 << 20) -> torch.Tensor:
    """Sum a 1-D ``tensor`` over 2 ranks in place with gloo's ring loop (p = 2 only)."""
    pg, rank = dist.group.WORLD, dist.get_rank()
    peer, n = 1 - rank, tensor.numel()
    per_rank = max(2, -(-n * tensor.element_size() // (2 * segment_bytes)))
    seg = -(-n // (2 * per_rank))
    spare = torch.empty(2, seg, dtype=tensor.dtype)

    def piece(owner: int, i: int) -> slice:
        start = min(n, (owner * per_rank + i) * seg)
        return slice(start, min(n, start + seg))

    def exchange(out: torch.Tensor, into: torch.Tensor) -> tuple:
        """Post a receive into ``into``, then a send of ``out``; an empty piece is no message
        (both ranks cut the same pieces, so they skip the same ones)."""
        recv = pg.recv([into], peer, 0) if into.numel() else None
        return recv, (pg.send([out], peer, 0) if out.numel() else None)

    def wait(work) -> None:
        if work is not None:
            work.wait()

    # reduce-scatter: send the peer's segments, add the peer's copy of ours
    posted = []
    for i in range(per_rank + 2):
        if i >= 2:
            (recv, send), mine = posted[i - 2]
            wait(recv)
            tensor[mine].add_(spare[i & 1][: mine.stop - mine.start])
            wait(send)  # as gloo: the reduction first, then the send's completion
        if i < per_rank:
            mine, theirs = piece(rank, i), piece(peer, i)
            incoming = spare[i & 1][: mine.stop - mine.start]
            posted.append((exchange(tensor[theirs], incoming), mine))
    # all-gather: send our reduced segments, receive theirs in place
    pending = []
    for i in range(per_rank + 2):
        if i >= 2:
            for work in pending[i - 2]:
                wait(work)
        if i < per_rank:
            pending.append(exchange(tensor[piece(rank, i)], tensor[piece(peer, i)]))
    return tensor


def _measure(rank: int, world_size: int, sizes: list[int], repeats: int, segment_bytes: int):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    candidates = {
        "torch": dist.all_reduce,
        "ring": ring_allreduce,
        "gloo_loop": lambda t: gloo_loop(t, segment_bytes),
    }
    rows = []
    for numel in sizes:
        data = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
        expected = data.clone()
        dist.all_reduce(expected)
        for name, fn in candidates.items():  # every candidate sums correctly
            got = data.clone()
            fn(got)
            torch.testing.assert_close(got, expected, msg=lambda m, name=name: f"{name}: {m}")
        tensor = torch.ones(numel)
        _time_interleaved(candidates, tensor, 3)
        times = _time_interleaved(candidates, tensor, repeats)
        for name, seconds in times.items():
            rows.append({"numel": numel, "algorithm": name, "median_s": seconds,
                         "torch_over_ours": times["torch"] / seconds})  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1 << 20, 1 << 22, 1 << 24])
    parser.add_argument("--repeats", type=int, default=100)
    parser.add_argument("--segment-bytes", type=int, default=1 << 20)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = run_on_ranks(_measure, 2, args.sizes, args.repeats, args.segment_bytes,
                        timeout=600)[0]  # fmt: skip
    if args.json:
        print(json.dumps({"world_size": 2, "backend": "gloo", "rows": rows}))
        return
    for r in rows:
        print(f"{r['numel']:>10} {r['algorithm']:>10} {r['median_s'] * 1e3:8.3f} ms"
              f"  torch/this {r['torch_over_ours']:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
