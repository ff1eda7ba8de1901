"""From per-rank traces to the step's dependency graph (:class:`~.ops.Graph`).

A rank's trace (:class:`~lightning_par.comm.trace.CommTrace`) holds its messages (post time,
``wait()`` time, return time, peer, bytes) and spans of its own work. The graph keeps what the
rank did and where it blocked, and forgets how long each block took:

* **main lane**: the time between blocks is :class:`~.ops.Compute`; each message the rank
  blocked on outside its compute spans becomes a :class:`~.ops.Post` at its post time and a
  :class:`~.ops.Wait` where it called ``wait()``; a ``wait for ...`` span (the plugins'
  ``wait for buckets`` / ``wait for pushes``) becomes a :class:`~.ops.Join` on the
  background lane, plus the span's own overhead after the last background message ended.
* **background lane**: messages the rank blocked on inside a ``bucket N``, compute or
  ``wait for`` span ran on the communication thread (a parameter server's pull is posted
  there but waited for by the next forward: its post is on this lane, its wait on the
  main lane). Gaps inside a
  bucket are its own work (the reduction); a gap outside one waited for backward to fill
  the next bucket, and becomes an :class:`~.ops.After` at the same point of the main
  lane's compute.

Sends and receives match as gloo and NCCL match them: the k-th send ``src -> dst`` with the
k-th receive at ``dst`` from ``src`` (as in :mod:`lightning_par.measure.breakdown`). A message
whose other end is not traced (a parameter server) or falls outside the replayed interval is
*one-sided*: it keeps its measured time beyond what the fitted link explains.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Sequence

from lightning_par.comm.trace import CommTrace, Message
from lightning_par.measure.breakdown import COMPUTE_EVENTS
from lightning_par.simulate.links import Link
from lightning_par.simulate.ops import After, Compute, Graph, Join, Msg, Post, Wait

Interval = tuple[float, float]


def _blocked_from(m: Message) -> float:
    return max(m.start, m.wait_start if m.wait_start is not None else m.start)


def _inside(t: float, spans: Sequence[Interval]) -> bool:
    return any(a <= t <= b for a, b in spans)


def match(traces: Sequence[CommTrace]) -> dict[tuple[int, int], tuple[int, int]]:
    """``(rank, index of the message in its trace) -> the other end's (rank, index)``."""
    sends: dict[tuple[int, int], list[tuple[float, int, int]]] = defaultdict(list)
    recvs: dict[tuple[int, int], list[tuple[float, int, int]]] = defaultdict(list)
    for t in traces:
        for i, m in enumerate(t.messages):
            if m.rank != t.rank:  # a subgroup's local numbering cannot be matched globally
                continue
            if m.op == "send":
                sends[(m.rank, m.peer)].append((m.start, t.rank, i))
            else:
                recvs[(m.peer, m.rank)].append((m.start, t.rank, i))
    pairs = {}
    for key in sends.keys() & recvs.keys():
        for (_, rs, i), (_, rr, j) in zip(sorted(sends[key]), sorted(recvs[key])):
            pairs[(rs, i)], pairs[(rr, j)] = (rr, j), (rs, i)
    return pairs


def transfer_samples(traces: Sequence[CommTrace]) -> list[tuple[int, float]]:
    """``(nbytes, seconds)`` of matched messages whose receiver was already blocked when both
    ends were posted: its return time is the arrival (for :func:`~.links.fit_link`)."""
    by_rank = {t.rank: t for t in traces}
    out = []
    for (rank, i), (peer, j) in match(traces).items():
        m = by_rank[rank].messages[i]
        if m.op != "recv":
            continue
        s = by_rank[peer].messages[j]
        both = max(by_rank[rank].origin + m.start, by_rank[peer].origin + s.start)
        blocked = by_rank[rank].origin + _blocked_from(m)
        if blocked <= both:
            out.append((m.nbytes, by_rank[rank].origin + m.end - both))
    return out


def build_graph(
    traces: Sequence[CommTrace],
    link: Link,
    windows: dict[int, Sequence[Interval]] | None = None,
) -> Graph:
    """The graph of ``traces`` over each rank's ``windows`` (absolute step intervals; default:
    from its first to its last record). ``link`` is the one the run used (fitted loopback):
    one-sided messages keep their measured time beyond it."""
    by_rank = {t.rank: t for t in traces}
    pairs = match(traces)
    graph = Graph(steps=min((len(w) for w in windows.values()), default=1) if windows else 1)
    bounds: dict[int, Interval] = {}
    for t in traces:
        if windows and t.rank in windows:
            bounds[t.rank] = (windows[t.rank][0][0], windows[t.rank][-1][1])
        else:
            times = [x for m in t.messages for x in (m.start, m.end)]
            times += [x for e in t.events for x in (e.start, e.end)]
            bounds[t.rank] = (t.origin + min(times), t.origin + max(times)) if times else (0, 0)
    origin = min(a for a, _ in bounds.values())
    ids: dict[tuple[int, int], int] = {}

    def message_id(rank: int, i: int) -> int:
        if (rank, i) in ids:
            return ids[(rank, i)]
        m = by_rank[rank].messages[i]
        src, dst = (rank, m.peer) if m.op == "send" else (m.peer, rank)
        other = pairs.get((rank, i))
        if other is not None and _posted_inside(by_rank[other[0]], other[1], bounds[other[0]]):
            ids[(rank, i)] = ids[other] = graph.message(Msg(src, dst, m.nbytes))
        else:
            extra = m.end - m.start - link.time(m.nbytes)  # < 0: the fit overestimates it
            ids[(rank, i)] = graph.message(Msg(src, dst, m.nbytes, True, extra))
        return ids[(rank, i)]

    for t in traces:
        _build_rank(graph, t, bounds[t.rank], origin, message_id)
    return graph


def _posted_inside(trace: CommTrace, i: int, bound: Interval) -> bool:
    return bound[0] <= trace.origin + trace.messages[i].start < bound[1]


def _build_rank(graph: Graph, t: CommTrace, bound: Interval, origin: float, message_id) -> None:
    o, (lo, hi) = t.origin, bound
    spans = [(o + e.start, o + e.end, e.name) for e in t.events]
    computing = [(a, b) for a, b, n in spans if n in COMPUTE_EVENTS]
    joins = sorted((a, b) for a, b, n in spans if n.startswith("wait") and lo <= a < hi)
    buckets = [(a, b) for a, b, n in spans if n.startswith("bucket")]
    main_items, bg_items = [], []  # (time, order, kind, payload)
    for i, m in enumerate(t.messages):
        post, blocked, end = o + m.start, o + _blocked_from(m), o + m.end
        if not lo <= post < hi:
            continue
        bg = any(_inside(blocked, spans) for spans in (buckets, computing, joins))
        # posted where it was posted (a server's pull: by the bucket thread), waited for
        # where the rank blocked on it, unless that is after the interval (the last step's
        # pull, waited for when training ends): the interval does not hold that wait
        (bg_items if bg or _inside(post, buckets) else main_items).append((post, 0, "post", i))
        if blocked < hi:
            (bg_items if bg else main_items).append((blocked, 1, "wait", (i, end)))
    bg_items.sort()
    bg_ends = [payload[1] for _, _, kind, payload in bg_items if kind == "wait"]
    for a, b in joins:
        main_items.append((a, 1, "join", b))
    main_items.sort()

    main = graph.lane(t.rank)
    graph.start[(t.rank, "main")] = lo - origin
    measured: list[Interval] = []  # each main op's measured interval (for anchors, charts)
    graph.measured[(t.rank, "main")] = measured
    joins_at: list[tuple[int, int]] = []  # (main op index, background waits it joins)
    cursor = lo

    def emit(op, a: float, b: float) -> None:
        main.append(op)
        measured.append((a, b))

    for time, _, kind, payload in main_items:
        if time > cursor:
            emit(Compute(time - cursor), cursor, time)
            cursor = time
        if kind == "post":
            emit(Post(message_id(t.rank, payload)), cursor, cursor)
        elif kind == "wait":
            emit(Wait(message_id(t.rank, payload[0])), cursor, max(cursor, payload[1]))
            cursor = max(cursor, payload[1])
        else:  # a join span: every background wait that ended before it ended
            last = max((e for e in bg_ends if e <= payload), default=time)
            if bg_ends:  # its wait count now, the background lane's op count once built
                joins_at.append((len(main), sum(1 for e in bg_ends if e <= payload)))
                emit(Join((t.rank, "bg"), 0), time, max(time, last))
            if payload > max(time, last):
                emit(Compute(payload - max(time, last), "overhead"), max(time, last), payload)
            cursor = max(cursor, payload)
    if hi > cursor:
        emit(Compute(hi - cursor), cursor, hi)
    if bg_items:
        after_wait = _build_bg(graph, t, bg_items, buckets, measured, lo - origin, message_id)
        for k, waits in joins_at:
            main[k] = Join((t.rank, "bg"), after_wait[waits - 1] if waits else 0)


def _build_bg(graph, t, bg_items, buckets, measured, start, message_id) -> list[int]:
    """The background lane (from the main lane's ``start``: its first message waits for the
    main lane to get where it was posted); returns its op count after each of its waits."""
    lane = graph.lane(t.rank, "bg")
    main = graph.lanes[(t.rank, "main")]
    starts = [a for a, _ in measured]
    cursor = measured[0][0] if measured else bg_items[0][0]
    graph.start[(t.rank, "bg")] = start
    wait_op_index: list[int] = []  # op index after the k-th background wait
    for time, _, kind, payload in bg_items:
        if time > cursor:
            same_bucket = any(a <= cursor and time <= b for a, b in buckets)
            k = bisect.bisect_right(starts, time) - 1
            held = k >= 0 and isinstance(main[k], (Join, Wait))
            if same_bucket or held or k < 0:
                lane.append(Compute(time - cursor, "reduce"))
            else:
                a, b = measured[k]
                lane.append(After((t.rank, "main"), k, (time - a) / (b - a) if b > a else 0.0))
            cursor = time
        if kind == "post":
            lane.append(Post(message_id(t.rank, payload)))
        else:
            lane.append(Wait(message_id(t.rank, payload[0])))
            cursor = max(cursor, payload[1])
            wait_op_index.append(len(lane))
    return wait_op_index
