"""Communication trace: one record per point-to-point message.

Every plugin sends its messages through :class:`~lightning_par.comm.p2p.Communicator`,
which appends a :class:`Message` here when a trace is attached. The course notebooks
draw their diagrams (who sends which chunk at which step) and Gantt charts from it, and
the tests compare its totals with the alpha-beta cost model.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Message:
    """One send or receive, as seen by the rank that posted it."""

    rank: int
    op: str  # "send" or "recv"
    peer: int
    nbytes: int
    start: float
    end: float
    step: int | None = None
    chunk: int | None = None
    tag: str = ""
    #: When the poster called ``wait()`` (``None`` in traces written before this field):
    #: ``wait_start .. end`` is the time it was blocked on this message.
    wait_start: float | None = None

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass
class Event:
    """A span of local work (forward, backward, reduce, ...) for timelines."""

    rank: int
    name: str
    start: float
    end: float
    micro_batch: int | None = None
    #: CPU seconds the recording thread ran inside the span (``time.thread_time``): its own
    #: work, without the time it waited for a core (``None`` in traces written before it)
    cpu: float | None = None


@dataclass
class CommTrace:
    """Messages and compute events recorded by one rank.

    Times come from ``time.perf_counter`` relative to :attr:`origin`, so traces of
    ranks started together can be drawn on one axis after :meth:`gather`.
    """

    rank: int = 0
    origin: float = field(default_factory=time.perf_counter)
    messages: list[Message] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)

    def now(self) -> float:
        return time.perf_counter() - self.origin

    def record(self, message: Message) -> None:
        self.messages.append(message)

    def span(self, name: str, micro_batch: int | None = None) -> _Span:
        """Context manager recording a compute :class:`Event`."""
        return _Span(self, name, micro_batch)

    def mark(self) -> tuple[float, float]:
        """Where a span opened elsewhere than it closes starts: (trace time, this thread's
        CPU time), for :meth:`close`."""
        return self.now(), time.thread_time()

    def close(self, name: str, mark: tuple[float, float], micro_batch: int | None = None) -> Event:
        """Record the :class:`Event` ``name`` from ``mark`` (:meth:`mark`, on this thread)
        to now."""
        event = Event(self.rank, name, mark[0], self.now(), micro_batch,
                      time.thread_time() - mark[1])  # fmt: skip
        self.events.append(event)
        return event

    @contextmanager
    def left_out(self) -> Iterator[None]:
        """What is sent and computed inside is not the run's (the checkpoint gathered for
        the script at the end of ``fit``): the trace keeps only what came before."""
        messages, events = len(self.messages), len(self.events)
        try:
            yield
        finally:
            del self.messages[messages:], self.events[events:]

    def clear(self) -> None:
        self.messages.clear()
        self.events.clear()
        self.origin = time.perf_counter()

    def sent(self) -> Iterator[Message]:
        return (m for m in self.messages if m.op == "send")

    @property
    def bytes_sent(self) -> int:
        return sum(m.nbytes for m in self.sent())

    @property
    def bytes_received(self) -> int:
        return sum(m.nbytes for m in self.messages if m.op == "recv")

    @property
    def messages_sent(self) -> int:
        return sum(1 for _ in self.sent())

    @property
    def steps(self) -> int:
        """Number of distinct algorithm steps this rank took part in."""
        return len({m.step for m in self.messages if m.step is not None})

    def totals(self) -> dict[str, int]:
        return {
            "rank": self.rank,
            "messages_sent": self.messages_sent,
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
        }

    def to_records(self) -> list[dict]:
        """Plain dicts (for pandas, JSON or ``all_gather_object``)."""
        return [asdict(m) for m in self.messages]

    def gather(self, group=None) -> list[CommTrace] | None:
        """Collect every rank's trace on rank 0 of ``group`` (``None`` elsewhere)."""
        import torch.distributed as dist

        if not dist.is_initialized():
            return [self]
        world = dist.get_world_size(group)
        out: list[CommTrace | None] = [None] * world
        dist.all_gather_object(out, self, group=group)
        return out if dist.get_rank(group) == 0 else None  # type: ignore[return-value]


class _Span:
    def __init__(self, trace: CommTrace, name: str, micro_batch: int | None) -> None:
        self.trace, self.name, self.micro_batch = trace, name, micro_batch

    def __enter__(self) -> _Span:
        self.start = self.trace.mark()
        return self

    def __exit__(self, *exc: object) -> None:
        self.trace.close(self.name, self.start, self.micro_batch)


def trace_to_dict(trace: CommTrace) -> dict:
    """A JSON-ready dict of ``trace`` (messages and events), loadable by :func:`trace_from_dict`."""
    return {
        "rank": trace.rank,
        "origin": trace.origin,
        "messages": trace.to_records(),
        "events": [asdict(e) for e in trace.events],
    }


def trace_from_dict(record: dict) -> CommTrace:
    return CommTrace(
        rank=record["rank"],
        origin=record["origin"],
        messages=[Message(**m) for m in record["messages"]],
        events=[Event(**e) for e in record["events"]],
    )


def save_trace(trace: CommTrace, path: str | os.PathLike) -> Path:
    """Write ``trace`` as JSON to ``path`` (folders are created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(trace_to_dict(trace)))
    return path


def load_trace(path: str | os.PathLike) -> CommTrace:
    """A trace saved by :func:`save_trace` (or a strategy's ``trace_dir``)."""
    return trace_from_dict(json.loads(Path(path).read_text()))


def load_traces(trace_dir: str | os.PathLike) -> list[CommTrace]:
    """Every rank's trace in ``trace_dir`` (``rank<N>.json``), ordered by rank."""
    traces = [load_trace(p) for p in Path(trace_dir).glob("rank*.json")]
    return sorted(traces, key=lambda t: t.rank)
