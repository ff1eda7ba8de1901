"""What ``bench faults`` loses, strategy by strategy: one :class:`FaultCase` per way a
strategy's ``fault_tolerant=True`` survives a lost process.

A case names the strategy, what is lost (``rank``: a training process; ``server``: a
parameter server), the options its runs give the strategy beyond its registered ones, the
fault (the last rank, or rank 0, or the last server, killed as a step begins) and how close the
survivors' final weights come to those of the same run without the fault, where the
strategy claims they are the same:

* ``ring_allreduce``: the survivors train the lost rank's shard, so the weights are one
  process's on the whole batch (:mod:`~lightning_par.components.fault_tolerance`), to float
  rounding (the gradients are summed over fewer ranks, in another order);
* ``local_sgd``: the lost replica is rebuilt by its right neighbour and replayed from the
  last averaging (:mod:`~lightning_par.components.replica_ring`), to float rounding (its
  steps run in another process's module, the replicas averaged in another order);
* ``parameter_server``, a server lost: the next server holds its shard's copy, weights and
  optimiser state after every step (:mod:`~lightning_par.paramserver.replication`), and the
  workers send it the same messages: the same weights (to 1e-6, as its tests);
* ``parameter_server``, a worker lost: the first live worker (the leader; worker 1 when
  worker 0 is the one lost) pushes the lost worker's share of the interrupted step in its
  slot and trains its batches beside its own from then on, their gradient pushed in that
  slot too (:mod:`~lightning_par.paramserver.lost_workers`): the servers sum the same
  gradients in the same worker order, so the same weights, bit for bit (tolerance 0; with
  the leader pushing the sum of its own and the lost worker's gradient, three workers ended
  3.3e-5 apart after 25 steps, ``benchmarks/faults.md``).

Float rounding grows as training goes on (each step's differences feed the next): with the
CIFAR CNN of width 32 on 3 ranks, the largest difference was about 2e-7 with 7 steps after
the fault and 3e-5 with 25 (``benchmarks/faults.md``), where the restart, which trains
other batches after its checkpoint, ended about 8e-2 away. Hence 1e-4 for the two that sum
in another order: wide enough for the benchmark's 40 steps, far below what other batches
make.

A new case is one more row of :data:`CASES`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class FaultCase:
    """One strategy losing one kind of process (module docstring). ``tolerance``: the
    largest difference of any parameter from the run without the fault that still counts
    as equal weights (``None``: the strategy does not claim equal weights)."""

    strategy: str
    lost: str
    options: Mapping[str, Any] = field(default_factory=dict)
    tolerance: float | None = None

    @property
    def name(self) -> str:
        """``strategy:lost``, as the runs are told which case they are."""
        return f"{self.strategy}:{self.lost}"

    @property
    def folder(self) -> str:
        """The folder of its runs' files."""
        return f"{self.strategy}-{self.lost}"

    def fault(self, world: int, step: int, first_rank: bool = False) -> str:
        """The ``LIGHTNING_PAR_FAULT`` value striking the last rank (of ``world``; rank 0 with
        ``first_rank``), or the last server, as ``step`` begins."""
        if self.lost == "server":
            return f"kill:server={self.options['num_servers'] - 1}:step={step}"
        return f"kill:rank={0 if first_rank else world - 1}:step={step}"


CASES = (
    FaultCase("ring_allreduce", "rank", tolerance=1e-4),
    FaultCase("local_sgd", "rank", {"period": 4}, tolerance=1e-4),
    FaultCase("parameter_server", "server", {"num_servers": 2}, tolerance=1e-6),
    FaultCase("parameter_server", "rank", {"num_servers": 1}, tolerance=0.0),
)


def case_named(name: str) -> FaultCase:
    """The case ``strategy:lost`` of :data:`CASES`."""
    return next(case for case in CASES if case.name == name)


def cases_for(strategies: list[str]) -> list[FaultCase]:
    """Every case of each of ``strategies``, in their order; ``ValueError`` naming those
    covered for a strategy with none."""
    covered = list(dict.fromkeys(case.strategy for case in CASES))
    unknown = [s for s in strategies if s not in covered]
    if unknown:
        raise ValueError(
            f"bench faults covers {', '.join(covered)}; no case for {', '.join(unknown)} "
            f"(a new one is a row of CASES in {__name__})"
        )
    return [case for s in strategies for case in CASES if case.strategy == s]


__all__ = ["CASES", "FaultCase", "case_named", "cases_for"]
