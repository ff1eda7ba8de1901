"""The 2-D grid of ranks behind hybrid parallelism: ``dp`` data-parallel replicas of a model
cut ``mp`` ways.

As in picotron's process-group manager (Hugging Face, 2025) and Megatron-LM's
``initialize_model_parallel`` (Shoeybi et al., 2019), every group comes from one reshape of
``arange(world)``: row ``d`` of ``arange(dp * mp).reshape(dp, mp)`` is replica ``d``'s
model-parallel group (its pipeline stages or tensor shards), column ``m`` is the
data-parallel group of stage/shard ``m`` (the ranks holding the same parameters, whose
gradients are averaged). Model-parallel ranks are consecutive, so on a multi-GPU node the
chattiest traffic (activations every micro-batch, or tensor-parallel allreduces every layer)
stays between neighbouring devices, and only gradients cross replicas, once per step.

Everything here but :func:`create_groups` is a plain function of integers (no
``torch.distributed``), so the layout can be tested and drawn without processes;
:func:`talk_groups` reads the groups back from what a real run's trace says who talked to
whom.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta

import torch

from lightning_par.comm.trace import CommTrace

#: The model-parallel degree when neither ``dp`` nor ``mp`` is given.
DEFAULT_MP = 2


@dataclass(frozen=True)
class Grid:
    """``dp`` replicas × ``mp`` model-parallel ranks; rank ``r`` sits at
    ``(r // mp, r % mp)`` = (data-parallel rank, model-parallel rank)."""

    dp: int
    mp: int

    @property
    def world_size(self) -> int:
        return self.dp * self.mp

    def table(self) -> torch.Tensor:
        """``arange(world).reshape(dp, mp)``: rows are mp groups, columns dp groups."""
        return torch.arange(self.world_size).reshape(self.dp, self.mp)

    def mp_groups(self) -> list[list[int]]:
        """The ranks of each replica, in stage/shard order."""
        return self.table().tolist()

    def dp_groups(self) -> list[list[int]]:
        """The ranks holding each stage/shard, in replica order."""
        return self.table().t().tolist()

    def coords(self, rank: int) -> tuple[int, int]:
        """``(dp_rank, mp_rank)`` of global ``rank``."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a grid of {self.world_size} ranks")
        return divmod(rank, self.mp)

    def dp_rank(self, rank: int) -> int:
        return self.coords(rank)[0]

    def mp_rank(self, rank: int) -> int:
        return self.coords(rank)[1]

    def mp_group_of(self, rank: int) -> list[int]:
        return self.mp_groups()[self.dp_rank(rank)]

    def dp_group_of(self, rank: int) -> list[int]:
        return self.dp_groups()[self.mp_rank(rank)]

    def describe(self) -> str:
        rows = "; ".join(str(g) for g in self.mp_groups())
        return f"{self.dp} x {self.mp} grid (dp x mp): model-parallel groups {rows}"


def groups_across_nodes(grid: Grid, per_node: int) -> str | None:
    """Why this grid's placement is slow when model-parallel groups span nodes, else None.

    Ranks fill nodes in order (``per_node`` each: Lightning, torchrun and ``srun``'s block
    distribution all number them so), and model-parallel ranks are consecutive, so each
    model-parallel group stays within one node exactly when ``mp`` divides ``per_node``.
    Otherwise the chattiest traffic (activations every micro-batch, tensor-parallel
    allreduces every layer) crosses the link between nodes, while only the once-a-step
    gradient allreduce would need to (Narayanan et al., 2021, arXiv:2104.04473, sec. 3.3:
    tensor parallelism within a node, data and pipeline parallelism across nodes).
    """
    spans = [g for g in grid.mp_groups() if len({r // per_node for r in g}) > 1]
    if not spans:
        return None
    return (
        f"hybrid: model-parallel group {spans[0]} (mp={grid.mp}) spans nodes of {per_node} "
        f"process(es) each, so its activations or per-layer allreduces cross the network "
        f"between nodes every micro-batch; it trains the same, but slower. Put the "
        f"model-parallel dimension within a node: choose mp dividing the processes per node "
        f"({per_node}) and let dp span the nodes"
    )


def _positive_int(name: str, value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1 (or None to derive it), got {value!r}")
    return value


def check_degrees(dp: int | None, mp: int | None) -> None:
    """Reject a ``dp`` or ``mp`` that is not a positive int (``None`` is allowed)."""
    _positive_int("dp", dp)
    _positive_int("mp", mp)


def make_grid(world_size: int, dp: int | None = None, mp: int | None = None) -> Grid:
    """The grid for ``world_size`` ranks: given both degrees, their product must be the world
    size; given one, the other is derived; given none, ``mp`` = :data:`DEFAULT_MP`."""
    dp, mp = _positive_int("dp", dp), _positive_int("mp", mp)
    fix = "set dp and mp so that dp * mp equals the number of processes (devices x nodes)"
    if dp is not None and mp is not None:
        if dp * mp != world_size:
            raise ValueError(
                f"hybrid grid dp={dp} x mp={mp} = {dp * mp} ranks but there are {world_size} "
                f"processes: {fix}"
            )
        return Grid(dp, mp)
    if dp is None and mp is None:
        mp = DEFAULT_MP
    given, value = ("mp", mp) if dp is None else ("dp", dp)
    if world_size % value:
        examples = dict.fromkeys([f"dp={world_size}, mp=1", f"dp=1, mp={world_size}"])
        raise ValueError(
            f"hybrid: {given}={value} does not divide the {world_size} processes"
            f"{' (mp defaults to 2)' if given == 'mp' and mp == DEFAULT_MP else ''}: {fix}, "
            f"e.g. {' or '.join(examples)}"
        )
    other = world_size // value
    return Grid(other, value) if given == "mp" else Grid(value, other)


@dataclass
class GridGroups:
    """This rank's two process groups (``None`` stands for the whole world when a degree
    equals the world size; torch needs no extra group then)."""

    grid: Grid
    dp_group: object
    mp_group: object


def create_groups(grid: Grid, rank: int, timeout: timedelta | None = None) -> GridGroups:
    """Create every mp group, then every dp group, on every rank (``dist.new_group`` is
    collective over the whole world, in the same order everywhere) and keep this rank's."""
    import torch.distributed as dist

    if dist.get_world_size() != grid.world_size:
        raise ValueError(f"{grid.describe()} but the process group has {dist.get_world_size()}")
    kwargs = {} if timeout is None else {"timeout": timeout}
    mine: dict[str, object] = {}
    for kind, groups in (("mp", grid.mp_groups()), ("dp", grid.dp_groups())):
        for ranks in groups:
            # a group of the whole world (or of one rank) still costs nothing to make, and
            # keeps the calls identical on every rank
            group = dist.new_group(ranks, **kwargs)
            if rank in ranks:
                mine[kind] = group
    return GridGroups(grid, dp_group=mine["dp"], mp_group=mine["mp"])


def talk_groups(traces: Iterable[CommTrace], tags: Iterable[str] | None = None,
                exclude: Iterable[str] = ()) -> list[list[int]]:  # fmt: skip
    """The groups of ranks that exchanged messages in ``traces`` (the connected components
    of who sent to whom, trace ranks and peers being global ranks), counting only messages
    whose tag is in ``tags`` (all when ``None``) and not in ``exclude``; sorted. Ranks that
    sent nothing form groups of one."""
    wanted = None if tags is None else set(tags)
    skip = set(exclude)
    parent: dict[int, int] = {}

    def root(r: int) -> int:
        while parent.setdefault(r, r) != r:
            r = parent[r]
        return r

    for trace in traces:
        root(trace.rank)
        for m in trace.messages:
            if (wanted is None or m.tag in wanted) and m.tag not in skip:
                parent[root(m.rank)] = root(m.peer)
    groups: dict[int, list[int]] = {}
    for r in sorted(parent):
        groups.setdefault(root(r), []).append(r)
    return sorted(groups.values())
