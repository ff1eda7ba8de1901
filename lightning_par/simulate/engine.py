"""The discrete-event engine: replay lanes of operations over a link model.

A :class:`Graph` is, per *lane* (``(rank, "main")`` and, where a rank communicates on a
background thread, ``(rank, "bg")``), an ordered list of operations:

* :class:`Compute` ``seconds`` of local work (divided by the rank's speed factor);
* :class:`Post` of one end of a :class:`Msg` (``isend``/``irecv``: returns at once);
* :class:`Wait` for a message: it completes ``alpha + beta * nbytes`` after *both* ends were
  posted (a rendezvous, as :mod:`lightning_par.measure.breakdown` reads the traces); a
  one-sided message (the peer has no trace, e.g. a parameter server) completes ``extra_s +
  alpha + beta * nbytes`` after its own post, ``extra_s`` (the peer's work: the server's
  update) scaled like the traced rank's compute;
* :class:`Join` another lane: wait until its first ``upto`` operations are done (the main
  thread's ``wait for buckets``);
* :class:`After`: not before another lane has run ``frac`` of its operation ``op`` (the
  communication thread cannot start a bucket before backward has filled it), plus
  ``delay_s`` of waiting.

Each lane runs its operations in order as soon as their inputs are known, so the schedule is
the one the program would follow on the modelled machine (a dataflow replay in the manner of
trace-driven network simulators such as LogGOPSim, Hoefler et al., HPDC 2010). Blocked time
is *waiting* while the peer had not posted its end yet, *communication* after.

With ``contention=True``, transfers that overlap on one rank's port of a ``shared`` link class
divide its bandwidth: each one's ``beta`` term is multiplied by the most transfers at once on
either end, iterated to a fixed point (a fair-share approximation). With ``cores=N``, compute
spans that overlap share ``N`` cores the same way (:mod:`.cores`: processor sharing).
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from dataclasses import dataclass, field

from lightning_par.simulate.cores import stretches
from lightning_par.simulate.links import Topology

Lane = tuple[int, str]


@dataclass(frozen=True)
class Msg:
    src: int
    dst: int
    nbytes: int
    one_sided: bool = False
    extra_s: float = 0.0


@dataclass(frozen=True)
class Compute:
    seconds: float
    name: str = "compute"


@dataclass(frozen=True)
class Comm:
    """``seconds`` of communication priced by a cost model (a whole collective), not scaled
    by the compute speed: what the scale-out graphs use where one rank stands for all."""

    seconds: float
    name: str = "collective"


@dataclass(frozen=True)
class Post:
    msg: int


@dataclass(frozen=True)
class Wait:
    msg: int


@dataclass(frozen=True)
class Join:
    lane: Lane
    upto: int


@dataclass(frozen=True)
class After:
    lane: Lane
    op: int
    frac: float = 0.0
    #: and ``delay_s`` more (waiting: the slowest of the ranks a lane stands for is late)
    delay_s: float = 0.0


Op = Compute | Comm | Post | Wait | Join | After


@dataclass
class Graph:
    """Lanes of operations, the messages they name and each lane's start time (s)."""

    lanes: dict[Lane, list[Op]] = field(default_factory=dict)
    messages: list[Msg] = field(default_factory=list)
    start: dict[Lane, float] = field(default_factory=dict)
    steps: int = 1
    #: Where each op ran in the measured run (graphs built from traces), for charts.
    measured: dict[Lane, list[tuple[float, float]]] = field(default_factory=dict)
    #: How many identical ranks a rank's lanes stand for (default 1), for core sharing.
    weight: dict[int, int] = field(default_factory=dict)

    def message(self, msg: Msg) -> int:
        self.messages.append(msg)
        return len(self.messages) - 1

    def lane(self, rank: int, name: str = "main") -> list[Op]:
        return self.lanes.setdefault((rank, name), [])

    @property
    def ranks(self) -> list[int]:
        return sorted({rank for rank, _ in self.lanes})


@dataclass
class Span:
    lane: Lane
    start: float
    end: float
    kind: str  # "compute", "communication", "waiting"
    label: str = ""


@dataclass
class Result:
    """Per rank: main-lane start, end and the split of its time; every span for charts."""

    start: dict[int, float]
    end: dict[int, float]
    split: dict[int, dict[str, float]]
    spans: list[Span]
    transfers: dict[int, tuple[float, float]]
    steps: int = 1
    #: ``(lane, op) -> (start, end, own seconds)`` of every compute span (for core sharing).
    computes: dict[tuple[Lane, int], tuple[float, float, float]] = field(default_factory=dict)

    def step_s(self, rank: int) -> float:
        return (self.end[rank] - self.start[rank]) / self.steps

    @property
    def mean_step_s(self) -> float:
        return sum(self.step_s(r) for r in self.end) / len(self.end)

    @property
    def max_step_s(self) -> float:
        return max(self.step_s(r) for r in self.end)

    def per_step_split(self, rank: int) -> dict[str, float]:
        return {k: v / self.steps for k, v in self.split[rank].items()}


def _speed(speed: float | dict[int, float], rank: int) -> float:
    value = speed.get(rank, 1.0) if isinstance(speed, dict) else speed
    if value <= 0:
        raise ValueError(f"compute speed of rank {rank} must be > 0, got {value}")
    return value


def _run(graph: Graph, topo: Topology, speed, share: dict[int, float],
         stretch: dict | None = None) -> Result:  # fmt: skip
    lanes = graph.lanes
    pc = {lane: 0 for lane in lanes}
    # a lane's start (the ranks' skew at the replayed window) is scaled like its compute
    clock = {lane: graph.start.get(lane, 0.0) / _speed(speed, lane[0]) for lane in lanes}
    starts: dict[Lane, list[float]] = {lane: [] for lane in lanes}
    ends: dict[Lane, list[float]] = {lane: [] for lane in lanes}
    posted: dict[int, dict[int, float]] = defaultdict(dict)
    done: dict[int, float] = {}
    transfers: dict[int, tuple[float, float]] = {}
    spans: list[Span] = []
    computes: dict[tuple[Lane, int], tuple[float, float, float]] = {}
    stretch = stretch or {}
    split = {r: {"compute": 0.0, "communication": 0.0, "waiting": 0.0} for r in graph.ranks}

    def complete(i: int) -> float | None:
        if i in done:
            return done[i]
        m, ends_ = graph.messages[i], posted.get(i, {})
        if m.one_sided:
            if not ends_:
                return None
            begin = min(ends_.values())
        elif m.src in ends_ and m.dst in ends_:
            begin = max(ends_.values())
        else:
            return None
        link = topo.link(m.src, m.dst)
        extra = m.extra_s / _speed(speed, m.src if (m.src, "main") in lanes else m.dst)
        took = max(0.0, link.alpha + link.beta * m.nbytes * share.get(i, 1.0) + extra)
        done[i], transfers[i] = begin + took, (begin, begin + took)
        return done[i]

    def record(lane: Lane, a: float, b: float, kind: str, label: str = "") -> None:
        if b > a:
            spans.append(Span(lane, a, b, kind, label))
            if lane[1] == "main":
                split[lane[0]][kind] += b - a

    progress = True
    while progress:
        progress = False
        for lane, ops in lanes.items():
            rank = lane[0]
            while pc[lane] < len(ops):
                op, t = ops[pc[lane]], clock[lane]
                if isinstance(op, Compute):
                    own = op.seconds / _speed(speed, rank)
                    new = t + own * stretch.get((lane, pc[lane]), 1.0)
                    computes[(lane, pc[lane])] = (t, new, own)
                    record(lane, t, new, "compute", op.name)
                elif isinstance(op, Comm):
                    new = t + op.seconds
                    record(lane, t, new, "communication", op.name)
                elif isinstance(op, Post):
                    posted[op.msg][rank] = t
                    new = t
                elif isinstance(op, Wait):
                    finish = complete(op.msg)
                    if finish is None:
                        break
                    new = max(t, finish)
                    other = [v for k, v in posted[op.msg].items() if k != rank]
                    ready = min(max(other, default=t), new)
                    record(lane, t, ready, "waiting", f"msg {op.msg}")
                    record(lane, max(t, ready), new, "communication", f"msg {op.msg}")
                elif isinstance(op, Join):
                    if pc[op.lane] < op.upto:
                        break
                    finish = max(ends[op.lane][: op.upto], default=t)
                    new = max(t, finish)
                    record(lane, t, new, "communication", "join")
                else:  # After
                    if len(starts[op.lane]) <= op.op:
                        break
                    a, b = starts[op.lane][op.op], ends[op.lane][op.op]
                    ready = a + op.frac * (b - a)
                    new = max(t, ready + op.delay_s)
                    record(lane, max(t, ready), new, "waiting", "slowest rank")
                starts[lane].append(t)
                ends[lane].append(new)
                clock[lane] = new
                pc[lane] += 1
                progress = True
    stuck = {lane: ops[pc[lane]] for lane, ops in lanes.items() if pc[lane] < len(ops)}
    if stuck:
        first = list(stuck.items())[:4]
        raise RuntimeError(f"the graph deadlocks: lanes blocked at {first} (a receive without "
                           "its send, or a join on a lane that waits for this one)")  # fmt: skip
    main = [lane for lane in lanes if lane[1] == "main"]
    return Result(
        start={r: graph.start.get((r, n), 0.0) / _speed(speed, r) for r, n in main},
        end={r: clock[(r, n)] for r, n in main},
        split={r: split[r] for r, _ in main},
        spans=spans,
        transfers=transfers,
        steps=graph.steps,
        computes=computes,
    )


def _shares(graph: Graph, topo: Topology, transfers: dict[int, tuple[float, float]]):
    """Most transfers at once on either end of each transfer over a shared link."""
    ports: dict[tuple[int, str], list[int]] = defaultdict(list)
    for i, m in enumerate(graph.messages):
        link = topo.link(m.src, m.dst)
        if link.shared and i in transfers:
            ports[(m.src, link.name)].append(i)
            ports[(m.dst, link.name)].append(i)
    share: dict[int, float] = {}
    for users in ports.values():
        # transfers at once just after each start (a sweep over the sorted starts and ends)
        starts = sorted(transfers[i][0] for i in users)
        ends = sorted(transfers[i][1] for i in users)
        level = [bisect.bisect_right(starts, x) - bisect.bisect_right(ends, x) for x in starts]
        for i in users:
            a, b = transfers[i]
            lo, hi = bisect.bisect_left(starts, a), bisect.bisect_left(starts, b)
            most = max(level[lo:hi], default=1)
            share[i] = max(share.get(i, 1.0), float(most))
    return share


def simulate(
    graph: Graph,
    topo: Topology,
    speed: float | dict[int, float] = 1.0,
    contention: bool = False,
    rounds: int = 20,
    cores: int | None = None,
    threads: int = 1,
) -> Result:
    """Replay ``graph`` on ``topo`` with compute ``speed`` (a factor, or one per rank: 2.0 runs
    that rank's compute twice as fast). ``cores``: compute spans that overlap share that many
    cores, each rank computing on ``threads`` threads (:mod:`.cores`); ``None``: every rank has
    its own processor. See the module docstring for the rules."""

    result = _run(graph, topo, speed, {})
    if not contention and cores is None:
        return result
    share: dict[int, float] = {}
    stretch: dict = {}
    for _ in range(rounds):
        new = _shares(graph, topo, result.transfers) if contention else {}
        more = stretches(result.computes, graph.weight, cores, threads) if cores else {}
        moved = max((abs(v - stretch.get(k, 1.0)) for k, v in more.items()), default=0.0)
        if new == share and moved < 1e-6:
            break
        share, stretch = new, more
        result = _run(graph, topo, speed, share, stretch)
    return result
