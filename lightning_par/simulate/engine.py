"""The discrete-event engine: replay lanes of operations over a link model.

A :class:`~.ops.Graph` is, per *lane* (``(rank, "main")`` and, where a rank communicates on
a background thread, ``(rank, "bg")``), an ordered list of operations (:mod:`.ops`):

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
  communication thread cannot start a bucket before backward has filled it).

Each lane runs its operations in order as soon as their inputs are known, so the schedule is
the one the program would follow on the modelled machine (a dataflow replay in the manner of
trace-driven network simulators such as LogGOPSim, Hoefler et al., HPDC 2010). Blocked time
is *waiting* while the peer had not posted its end yet, *communication* after.

With ``contention=True``, transfers that overlap on one rank's port of a ``shared`` link class
divide its bandwidth: each one's ``beta`` term is multiplied by the most transfers at once on
either end, iterated to a fixed point (a fair-share approximation). With ``cores=N``, compute
spans (and :class:`~.ops.Comm` spans ``on_cores``: loopback messages are CPU work) that
overlap share ``N`` cores the same way, less the ``other_load`` other processes take
(:mod:`.cores`: processor sharing); the time a span waits for a core is reported apart
(:attr:`Result.core_wait`).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field, replace

from lightning_par.simulate.cores import balanced_placements, stretches, turn_factor
from lightning_par.simulate.links import Topology, transfers_at_once
from lightning_par.simulate.ops import Comm, Compute, Graph, Join, Lane, Op, Post, Wait


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
    #: per rank, ``compute`` / ``communication``: seconds its spans waited for a core (the
    #: part of their time beyond their own work, all lanes of the rank)
    core_wait: dict[int, dict[str, float]] = field(default_factory=dict)
    #: where ranks placed whole on the cores may land several ways, the mean of their
    #: slowest ranks' steps (this result is the placement nearest it)
    expected_step_s: float | None = None

    def step_s(self, rank: int) -> float:
        return (self.end[rank] - self.start[rank]) / self.steps

    @property
    def mean_step_s(self) -> float:
        return sum(self.step_s(r) for r in self.end) / len(self.end)

    @property
    def max_step_s(self) -> float:
        """The slowest rank's step (over the placements the ranks may land on: their mean)."""
        if self.expected_step_s is not None:
            return self.expected_step_s
        return max(self.step_s(r) for r in self.end)

    def per_step_split(self, rank: int) -> dict[str, float]:
        return {k: v / self.steps for k, v in self.split[rank].items()}

    def per_step_core_wait(self, rank: int) -> dict[str, float]:
        waited = self.core_wait.get(rank, {})
        return {k: waited.get(k, 0.0) / self.steps for k in ("compute", "communication")}


def _speed(speed: float | dict[int, float], rank: int) -> float:
    value = speed.get(rank, 1.0) if isinstance(speed, dict) else speed
    if value <= 0:
        raise ValueError(f"compute speed of rank {rank} must be > 0, got {value}")
    return value


class _Replay:
    """One replay of ``graph``: each lane's program counter and clock, the messages posted
    and done, and the spans and split the :class:`Result` reports."""

    def __init__(self, graph: Graph, topo: Topology, speed, share: dict[int, float],
                 stretch: dict | None = None, turn_cost=None,
                 turns: dict | None = None) -> None:  # fmt: skip
        self.graph, self.topo, self.speed, self.share = graph, topo, speed, share
        # turns: how many times over the ranks alone share the cores under each span (what
        # the cost of taking turns follows: other processes' share is in the base's CPU)
        self.stretch, self.turn_cost, self.turns = stretch or {}, turn_cost, turns or {}
        lanes = graph.lanes
        self.pc = {lane: 0 for lane in lanes}
        # a lane's start (the ranks' skew at the replayed window) is scaled like its compute
        self.clock = {lane: graph.start.get(lane, 0.0) / _speed(speed, lane[0]) for lane in lanes}
        self.starts: dict[Lane, list[float]] = {lane: [] for lane in lanes}
        self.ends: dict[Lane, list[float]] = {lane: [] for lane in lanes}
        self.posted: dict[int, dict[int, float]] = defaultdict(dict)
        self.done: dict[int, float] = {}
        self.transfers: dict[int, tuple[float, float]] = {}
        self.spans: list[Span] = []
        self.computes: dict[tuple[Lane, int], tuple[float, float, float]] = {}
        self.split = {r: {"compute": 0.0, "communication": 0.0, "waiting": 0.0}
                      for r in graph.ranks}  # fmt: skip
        self.core_wait = {r: {"compute": 0.0, "communication": 0.0} for r in graph.ranks}

    def complete(self, i: int) -> float | None:
        """When message ``i`` has arrived, or None while an end it needs is not posted."""
        if i in self.done:
            return self.done[i]
        m, ends = self.graph.messages[i], self.posted.get(i, {})
        if m.one_sided:
            if not ends:
                return None
            begin = min(ends.values())
        elif m.src in ends and m.dst in ends:
            begin = max(ends.values())
        else:
            return None
        link = self.topo.link(m.src, m.dst)
        computing = m.src if (m.src, "main") in self.graph.lanes else m.dst
        extra = m.extra_s / _speed(self.speed, computing)
        took = max(0.0, link.alpha + link.beta * m.nbytes * self.share.get(i, 1.0) + extra)
        self.done[i], self.transfers[i] = begin + took, (begin, begin + took)
        return self.done[i]

    def record(self, lane: Lane, a: float, b: float, kind: str, label: str = "") -> None:
        if b > a:
            self.spans.append(Span(lane, a, b, kind, label))
            if lane[1] == "main":
                self.split[lane[0]][kind] += b - a

    def advance(self, lane: Lane, op: Op, t: float) -> float | None:
        """Run ``op``, the next operation of ``lane``, from ``t``: when it ends, or None
        while it is blocked."""
        rank = lane[0]
        if isinstance(op, Compute):
            stretch = self.stretch.get((lane, self.pc[lane]), 1.0)
            turns = (turn_factor(self.turns.get((lane, self.pc[lane]), 1.0), self.turn_cost)
                     if op.turns else 1.0)  # fmt: skip
            own = op.seconds / _speed(self.speed, rank) * turns
            new = t + own * stretch
            self.computes[(lane, self.pc[lane])] = (t, new, own)
            self.record(lane, t, new, "compute", op.name)
            self.core_wait[rank]["compute"] += new - t - own
        elif isinstance(op, Comm):
            new = t + op.seconds * (self.stretch.get((lane, self.pc[lane]), 1.0)
                                    if op.on_cores else 1.0)  # fmt: skip
            if op.on_cores:
                self.computes[(lane, self.pc[lane])] = (t, new, op.seconds)
                self.core_wait[rank]["communication"] += new - t - op.seconds
            self.record(lane, t, new, "communication", op.name)
        elif isinstance(op, Post):
            self.posted[op.msg][rank] = t
            new = t
        elif isinstance(op, Wait):
            finish = self.complete(op.msg)
            if finish is None:
                return None
            new = max(t, finish)
            other = [v for k, v in self.posted[op.msg].items() if k != rank]
            ready = min(max(other, default=t), new)
            self.record(lane, t, ready, "waiting", f"msg {op.msg}")
            self.record(lane, max(t, ready), new, "communication", f"msg {op.msg}")
        elif isinstance(op, Join):
            if self.pc[op.lane] < op.upto:
                return None
            new = max(t, max(self.ends[op.lane][: op.upto], default=t))
            self.record(lane, t, new, "communication", "join")
        else:  # After
            if len(self.starts[op.lane]) <= op.op:
                return None
            a, b = self.starts[op.lane][op.op], self.ends[op.lane][op.op]
            ready = a + op.frac * (b - a)
            new = max(t, ready)
        return new

    def run(self) -> Result:
        lanes, pc = self.graph.lanes, self.pc
        progress = True
        while progress:
            progress = False
            for lane, ops in lanes.items():
                while pc[lane] < len(ops):
                    t = self.clock[lane]
                    new = self.advance(lane, ops[pc[lane]], t)
                    if new is None:
                        break
                    self.starts[lane].append(t)
                    self.ends[lane].append(new)
                    self.clock[lane] = new
                    pc[lane] += 1
                    progress = True
        stuck = {lane: ops[pc[lane]] for lane, ops in lanes.items() if pc[lane] < len(ops)}
        if stuck:
            first = list(stuck.items())[:4]
            raise RuntimeError(f"the graph deadlocks: lanes blocked at {first} (a receive "
                               "without its send, or a join on a lane that waits for this "
                               "one)")  # fmt: skip
        main = [lane for lane in lanes if lane[1] == "main"]
        return Result(
            start={r: self.graph.start.get((r, n), 0.0) / _speed(self.speed, r) for r, n in main},
            end={r: self.clock[(r, n)] for r, n in main},
            split={r: self.split[r] for r, _ in main},
            spans=self.spans,
            transfers=self.transfers,
            steps=self.graph.steps,
            computes=self.computes,
            core_wait={r: self.core_wait[r] for r, _ in main},
        )


def simulate(
    graph: Graph,
    topo: Topology,
    speed: float | dict[int, float] = 1.0,
    contention: bool = False,
    rounds: int = 20,
    cores: int | None = None,
    threads: int = 1,
    other_load: float = 0.0,
    turn_cost: tuple[float, float] | None = None,
) -> Result:
    """Replay ``graph`` on ``topo`` with compute ``speed`` (a factor, or one per rank: 2.0 runs
    that rank's compute twice as fast). ``cores``: compute spans that overlap share that many
    cores, less ``other_load`` cores' worth that other processes take, each rank computing on
    ``threads`` threads (:mod:`.cores`), each span's CPU growing by ``turn_cost`` as far as
    it shares them (:func:`.cores.turn_factor`); ``None``: every rank has its own processor.
    See the module docstring for the rules."""

    alone = _Replay(graph, topo, speed, {}).run()
    if not contention and cores is None:
        return alone

    def settle(placed: dict[int, int] | None) -> Result:  # to the fixed point of the sharing
        result, share, stretch = alone, {}, {}
        for _ in range(rounds):
            new = transfers_at_once(graph, topo, result.transfers) if contention else {}
            more = (stretches(result.computes, graph.weight, cores, threads, other_load,
                              placed) if cores else {})  # fmt: skip
            moved = max((abs(v - stretch.get(k, 1.0)) for k, v in more.items()), default=0.0)
            if new == share and moved < 1e-6:
                break
            share, stretch = new, more
            turns = (stretches(result.computes, graph.weight, cores, threads, placed=placed)
                     if turn_cost else {})  # fmt: skip
            result = _Replay(graph, topo, speed, share, stretch, turn_cost, turns).run()
        return result

    ways = _placements(graph, alone, cores, threads, other_load)
    weighed = [(w, settle(at)) for w, at in ways]
    if len(weighed) == 1:
        return weighed[0][1]
    # a run lands on any of the placements: the expected step, and the placement's replay
    # nearest it for the split
    expected = sum(w * r.max_step_s for w, r in weighed)
    nearest = min((r for _, r in weighed), key=lambda r: abs(r.max_step_s - expected))
    return replace(nearest, expected_step_s=expected)


#: Cores' worth of other processes' CPU beyond which ranks are not placed whole: the load
#: balancer moves them among the other processes' tasks (a 4-stage pipeline beside a
#: training job ran as evenly shared, placed whole it was predicted 13 % long).
PLACED_UNDER_LOAD = 0.25


def _placements(graph: Graph, alone: Result, cores: int | None, threads: int,
                other_load: float = 0.0) -> list[tuple[float, dict[int, int] | None]]:  # fmt: skip
    """Where ``graph``'s ranks run, each way with its weight: shared evenly over the cores
    (``None``) unless they are placed whole (``placed``: ranks of one thread, more than
    the cores, beside little other load); then each placement a run may land on
    (:func:`.cores.balanced_placements`), by the ranks' own work when each has a
    processor."""
    ranks = graph.ranks
    if (not graph.placed or not cores or threads != 1 or len(ranks) <= cores
            or other_load > PLACED_UNDER_LOAD):  # fmt: skip
        return [(1.0, None)]
    work = dict.fromkeys(ranks, 0.0)
    for (lane, _), (_, _, own) in alone.computes.items():
        work[lane[0]] += own
    return balanced_placements(work, cores)
