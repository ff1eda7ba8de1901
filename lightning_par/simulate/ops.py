"""What a step graph is made of: per *lane* (``(rank, "main")`` and, where a rank
communicates on a background thread, ``(rank, "bg")``) an ordered list of operations, and
the messages they name. How each operation runs: :mod:`.engine`."""

from __future__ import annotations

from dataclasses import dataclass, field

Lane = tuple[int, str]


class NotApplicable(ValueError):
    """The strategy cannot run at that many devices (the reason is the message)."""


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
    #: whether it pays the cost of taking turns on the cores (:func:`~.cores.turn_factor`):
    #: the model's own work does, whose data the ranks evict from each other's caches
    turns: bool = True


@dataclass(frozen=True)
class Comm:
    """``seconds`` of communication priced by a cost model (a whole collective), not scaled
    by the compute speed: what the scale-out graphs use where one rank stands for all.
    ``on_cores``: the link is this machine's loopback, so moving the bytes is the ranks' own
    CPU work (copies, system calls, the reduction), which shares the cores as compute does
    (:mod:`.cores`)."""

    seconds: float
    name: str = "collective"
    on_cores: bool = False


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
    #: How many identical ranks a rank's lanes stand for (default 1), for core sharing (a
    #: fraction where the ranks it stands for do less than it in all).
    weight: dict[int, float] = field(default_factory=dict)
    #: Whether its ranks, of unequal work, share the cores as whole ranks placed on them
    #: (:func:`~.cores.place`: pipeline stages) rather than evenly over all of them.
    placed: bool = False

    def message(self, msg: Msg) -> int:
        self.messages.append(msg)
        return len(self.messages) - 1

    def lane(self, rank: int, name: str = "main") -> list[Op]:
        return self.lanes.setdefault((rank, name), [])

    @property
    def ranks(self) -> list[int]:
        return sorted({rank for rank, _ in self.lanes})
