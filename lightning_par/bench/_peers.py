"""A peer that fails is a row of the report, not the end of the benchmark.

Every benchmark measures our code beside a peer: torch's own pipeline schedules, gloo's
allreduce, torch's DDP and DTensor, Lightning's DDP, a plain training loop. On torch 2.11
three of torch's schedules stopped with gloo's "Pair is not connected", and the whole
pipeline benchmark died with them, ours included. Here a peer's failure (it raises, a rank
dies in it, it hangs) becomes ``{"failed": "<one line>"}`` in its row and the rest is
measured; a failure of ours still ends the run with its traceback.

A peer runs in one of two places:

* in the benchmark's own process (a ``Trainer`` fit, which starts its own ranks, or a plain
  loop): :func:`attempt` runs it under a time limit and turns an exception into the failure
  (the launchers stop a fit's ranks on the way out);
* inside ranks that also run ours (:func:`run_with_peers`, :class:`PeerGuard`): each peer
  talks over a process group of its own with a short timeout, so a peer that raises on one
  rank leaves the others waiting in it at most that long and never on our group; after each
  try the ranks agree, on our group, whether it failed anywhere, and skip it from then on.
  Each rank notes in a file which peer it is in; when a rank dies or hangs inside a peer
  (the others then fail agreeing on it), the ranks start again without that peer (a rank
  that failed outside every peer is ours: the error stands).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from lightning_par.comm import run_on_ranks
from lightning_par.launch.processes import TimeLimitExceeded, time_limit
from lightning_par.launch.run import RankFailed

T = TypeVar("T")

#: Seconds a peer's collective or receive waits for the other ranks before it fails (a peer
#: that raised on one rank leaves the others waiting this long); ``LIGHTNING_PAR_PEER_TIMEOUT``.
PEER_TIMEOUT_S = 120.0
#: Seconds a peer run in the benchmark's own process (a fit, a loop) may take;
#: ``LIGHTNING_PAR_PEER_RUN_LIMIT``.
PEER_RUN_LIMIT_S = 900.0


def peer_timeout_s() -> float:
    return float(os.environ.get("LIGHTNING_PAR_PEER_TIMEOUT", PEER_TIMEOUT_S))


def peer_run_limit_s() -> float:
    return float(os.environ.get("LIGHTNING_PAR_PEER_RUN_LIMIT", PEER_RUN_LIMIT_S))


def one_line(err: BaseException) -> str:
    """An exception as one line: its type and the first line of its message."""
    text = f"{type(err).__name__}: {err}".strip().splitlines()[0]
    return text if len(text) <= 240 else text[:237] + "..."


def attempt(name: str, fn: Callable[[], T], limit_s: float | None = None,
            ) -> tuple[T | None, str | None]:  # fmt: skip
    """``fn()`` of the peer ``name`` in this process, for at most ``limit_s`` seconds
    (default :func:`peer_run_limit_s`): its result and ``None``, or ``None`` and the failure
    as one line."""
    limit_s = peer_run_limit_s() if limit_s is None else limit_s
    message = f"peer {name!r} ran past its {limit_s:g} s limit"
    try:
        with time_limit(limit_s, message):
            return fn(), None
    except TimeLimitExceeded as err:
        if str(err) != message:  # an outer limit (the benchmark's own) ended it: not the peer
            raise
        return None, one_line(err)
    except Exception as err:  # the peer's failure, whatever it is, is its row
        return None, one_line(err)


@dataclass
class PeerGuard:
    """What one rank runs of the peers (made by :func:`run_with_peers`, one per rank).

    Args:
        marks: folder where each rank writes the peer it is in (``rank<r>``), removed once
            the ranks agreed how it went. ``None``: no guard at all, for a rank function
            called on its own (a test that must fail on any failure): every peer runs on
            the default group and its failure raises.
        failed: peer name -> failure, agreed by every rank; peers found failed in an earlier
            start come in here and are not run again.
        timeout_s: the timeout of each peer's own process group.
    """

    marks: str | None = None
    failed: dict[str, str] = field(default_factory=dict)
    timeout_s: float = PEER_TIMEOUT_S
    _groups: dict[str, Any] = field(default_factory=dict, repr=False)

    def group(self, name: str) -> dist.ProcessGroup | None:
        """The peer's own gloo group over every rank (made on first use: every rank must
        ask for the peers' groups in the same order); unguarded, the default group."""
        if self.marks is None:
            return None
        if name not in self._groups:
            self._groups[name] = dist.new_group(
                backend="gloo", timeout=timedelta(seconds=self.timeout_s)
            )
        return self._groups[name]

    def run(self, name: str, fn: Callable[[], T]) -> T | None:
        """``fn()`` of the peer ``name`` on every rank: its result, or ``None`` on every rank
        when it raised on any (the failure is then in :attr:`failed`; the peer is not run
        again). Every rank calls this for the same peers in the same order."""
        if self.marks is None:
            return fn()
        if name in self.failed:
            return None
        mark = Path(self.marks) / f"rank{dist.get_rank()}"
        mark.write_text(name)
        try:
            result, error = fn(), None
        except Exception as err:  # the peer's failure: agreed below, then a row
            result, error = None, one_line(err)
        errors = self._agree(error)
        mark.unlink()
        if errors:
            self.failed[name] = "; ".join(errors)
            return None
        return result

    @staticmethod
    def _agree(error: str | None) -> list[str]:
        """Every rank's failure (``rank r: ...``), the same list on every rank; empty when
        none failed. Runs on the default group: ours, untouched by the peer."""
        flag = torch.tensor([error is not None], dtype=torch.int32)
        dist.all_reduce(flag)
        if not flag.item():
            return []
        errors: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
        return [f"rank {r}: {e}" for r, e in enumerate(errors) if e is not None]


def _rank_with_guard(rank: int, world_size: int, fn: Callable, guard: PeerGuard, *args,
                     **kwargs) -> tuple[Any, dict[str, str]]:  # fmt: skip
    return fn(rank, world_size, *args, guard=guard, **kwargs), guard.failed


def run_with_peers(fn: Callable[..., T], world_size: int, *args: Any, timeout: float,
                   **kwargs: Any) -> tuple[list[T], dict[str, str]]:  # fmt: skip
    """``run_on_ranks(fn, world_size, *args, guard=PeerGuard(...), **kwargs)``, surviving its
    peers: every rank's result and the failed peers (name -> one line). ``fn`` runs each
    peer through ``guard.run`` on ``guard.group(name)``. A start in which a rank died or hung
    inside a peer is started again without it; a failure outside every peer raises
    :class:`~lightning_par.launch.run.RankFailed` as it came."""
    failed: dict[str, str] = {}
    while True:
        with tempfile.TemporaryDirectory(prefix="lightning_par-peers-") as marks:
            guard = PeerGuard(marks, dict(failed), peer_timeout_s())
            try:
                out = run_on_ranks(_rank_with_guard, world_size, fn, guard, *args,
                                   timeout=timeout, **kwargs)  # fmt: skip
            except RankFailed as err:
                culprits = _lost_in(err, Path(marks))
                if not culprits:
                    raise
                failed.update({name: f"a rank was lost in it: {_summary(err)}"
                               for name in culprits})  # fmt: skip
                continue
        return [result for result, _ in out], out[0][1]


def _summary(err: RankFailed) -> str:
    """One line of a failed start: the first rank's fate (a raise: with its exception)."""
    lines = [ln for ln in str(err).strip().splitlines() if ln.strip()]
    if err.dead or err.hung or len(lines) < 2:
        return lines[0] if lines else "no report"
    block = lines[1:]  # the first traceback, up to the next rank's report
    end = next((i for i, ln in enumerate(block) if ln.startswith("rank ")), len(block))
    return f"{lines[0]} {block[max(end - 1, 0)].strip()}"


def _lost_in(err: RankFailed, marks: Path) -> set[str]:
    """The peers the failed ranks (dead, raised, or hung at the deadline) were in; empty when
    any of them was outside every peer: then the failure is ours. (A peer's exception is
    caught inside the peer; a rank raises inside one only when the ranks' agreement on it
    failed: another rank died or hangs in it.)"""
    lost = {*err.dead, *err.raised, *err.hung}
    names = [(marks / f"rank{r}").read_text() if (marks / f"rank{r}").exists() else None
             for r in sorted(lost)]  # fmt: skip
    return set() if not names or None in names else set(names)  # type: ignore[arg-type]
