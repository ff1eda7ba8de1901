"""Where a step's time went: compute, communication, waiting (from the traces).

Every plugin sends through :class:`~lightning_par.comm.Communicator`, whose trace records each
message's post time, the time its poster called ``wait()`` and when that returned, and the
plugins' own spans (``fwd``/``bwd``/``backward`` compute, ``wait for ...`` blocks,
``average``). All ranks' clocks are ``time.perf_counter`` (one monotonic clock per machine),
so ``origin + t`` puts every rank on one axis and a receive can be matched with its send.

Each instant of a rank's step (from one step start to the next) gets exactly one label:

1. **compute** if a plugin's compute span covers it (communication on a background thread
   then is *overlapped*: counted in ``overlapped_s``, not in the step);
2. **waiting** if the rank is blocked on a message whose matching send (or receive) the
   peer had not posted yet: the peer was still busy (a straggler, a pipeline bubble);
3. **communication** if the rank is blocked on a message that is moving, or inside a
   communication span (``wait for buckets``, ``average``);
4. **compute** otherwise: forward, optimiser, loading the next batch, the framework.

So ``compute_s + communication_s + waiting_s`` is the step time by construction; what the
split adds is *which* part of it each plugin spends blocked. Messages to processes without
a trace (parameter servers) cannot be matched: their blocked time is all communication.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence

from lightning_par.comm.trace import CommTrace

Interval = tuple[float, float]

#: Event names that are the rank's own computation (pipeline ``fwd``/``bwd``, backward).
COMPUTE_EVENTS = frozenset({"fwd", "bwd", "forward", "backward"})


def is_comm_event(name: str) -> bool:
    """Spans in which the rank is blocked in communication as a whole."""
    return name.startswith("wait") or name == "average"


# ---- interval arithmetic on sorted, disjoint lists --------------------------------------------
def union(intervals: Iterable[Interval]) -> list[Interval]:
    out: list[Interval] = []
    for a, b in sorted(i for i in intervals if i[1] > i[0]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def intersect(xs: Sequence[Interval], ys: Sequence[Interval]) -> list[Interval]:
    out, i, j = [], 0, 0
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        if a < b:
            out.append((a, b))
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(xs: Sequence[Interval], ys: Sequence[Interval]) -> list[Interval]:
    out = []
    for a, b in xs:
        cur = a
        for c, d in ys:
            if d <= cur or c >= b:
                continue
            if c > cur:
                out.append((cur, c))
            cur = max(cur, d)
        if cur < b:
            out.append((cur, b))
    return out


def measure(xs: Iterable[Interval]) -> float:
    return sum(b - a for a, b in xs)


# ---- blocked time per message -------------------------------------------------------------------
def _partner_posts(traces: Sequence[CommTrace]) -> dict[tuple[int, int, str, int], float]:
    """For the k-th send ``src -> dst`` and the k-th receive at ``dst`` from ``src`` (in post
    order, as gloo and NCCL match them), the absolute post time of the other end. Pairs
    whose counts differ (subgroups, untraced peers) are left out."""
    sends: dict[tuple[int, int], list[float]] = defaultdict(list)
    recvs: dict[tuple[int, int], list[float]] = defaultdict(list)
    for t in traces:
        for m in t.messages:
            if m.rank != t.rank:  # a subgroup's local numbering: cannot be matched globally
                continue
            side = sends if m.op == "send" else recvs
            key = (m.rank, m.peer) if m.op == "send" else (m.peer, m.rank)
            side[key].append(t.origin + m.start)
    out = {}
    for key in sends.keys() & recvs.keys():
        s, r = sorted(sends[key]), sorted(recvs[key])
        if len(s) != len(r):
            continue
        for k, (ts, tr) in enumerate(zip(s, r)):
            out[(key[0], key[1], "send", k)] = tr  # a send's partner is the receive
            out[(key[0], key[1], "recv", k)] = ts
    return out


def blocked_intervals(
    trace: CommTrace, partners: dict[tuple[int, int, str, int], float]
) -> tuple[list[Interval], list[Interval]]:
    """(``waiting``, ``moving``): absolute intervals in which ``trace``'s rank was blocked in
    ``wait()`` before the peer posted the other end, and after."""
    waiting, moving = [], []
    counters: dict[tuple[int, int, str], int] = defaultdict(int)
    for m in sorted(trace.messages, key=lambda m: m.start):
        key = (m.rank, m.peer) if m.op == "send" else (m.peer, m.rank)
        k = counters[(*key, m.op)]
        counters[(*key, m.op)] += 1
        start = trace.origin + max(m.start, m.wait_start if m.wait_start is not None else m.start)
        end = trace.origin + m.end
        partner = partners.get((*key, m.op, k)) if m.rank == trace.rank else None
        if partner is not None and partner > start:
            waiting.append((start, min(partner, end)))
            start = min(partner, end)
        moving.append((start, end))
    return union(waiting), union(moving)


def split_rank(
    trace: CommTrace | None,
    windows: Sequence[Interval],
    partners: dict[tuple[int, int, str, int], float],
) -> dict[str, float]:
    """Seconds of compute, communication, waiting and overlapped communication summed over
    ``windows`` (absolute step intervals) of one rank."""
    step = measure(windows)
    if trace is None:
        return {"compute": step, "communication": 0.0, "waiting": 0.0, "overlapped": 0.0}
    win = union(windows)
    abs_span = [(trace.origin + e.start, trace.origin + e.end) for e in trace.events]
    compute = union(s for s, e in zip(abs_span, trace.events) if e.name in COMPUTE_EVENTS)
    comm_spans = union(s for s, e in zip(abs_span, trace.events) if is_comm_event(e.name))
    waiting, moving = blocked_intervals(trace, partners)
    compute_w = intersect(compute, win)
    wait_w = subtract(subtract(intersect(waiting, win), moving), compute_w)
    busy = union([*moving, *waiting, *comm_spans])
    comm_w = subtract(subtract(intersect(busy, win), compute_w), wait_w)
    overlapped = intersect(intersect(union([*moving, *waiting]), compute_w), win)
    w, c = measure(wait_w), measure(comm_w)
    return {"compute": step - w - c, "communication": c, "waiting": w,
            "overlapped": measure(overlapped)}  # fmt: skip


def split_steps(
    traces: dict[int, CommTrace], windows: dict[int, list[Interval]]
) -> dict[int, dict[str, float]]:
    """:func:`split_rank` for every rank with step ``windows``, per step (divided by the
    number of windows)."""
    partners = _partner_posts(list(traces.values()))
    out = {}
    for rank, wins in windows.items():
        parts = split_rank(traces.get(rank), wins, partners)
        out[rank] = {k: v / max(len(wins), 1) for k, v in parts.items()}
    return out


def bytes_sent_in(trace: CommTrace | None, windows: Sequence[Interval]) -> int | None:
    """Bytes this rank sent in messages posted inside ``windows`` (``None``: no trace)."""
    if trace is None:
        return None
    win = union(windows)
    return sum(m.nbytes for m in trace.sent() if _inside(trace.origin + m.start, win))


def _inside(t: float, win: Sequence[Interval]) -> bool:
    return any(a <= t < b for a, b in win)


__all__ = [
    "COMPUTE_EVENTS",
    "blocked_intervals",
    "bytes_sent_in",
    "intersect",
    "measure",
    "split_rank",
    "split_steps",
    "subtract",
    "union",
]
