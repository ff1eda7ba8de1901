"""Which server holds which parameter bytes: the sharding plan (a pure function).

Parameters are spread over ``S`` servers balanced by bytes (Li et al., "Scaling Distributed
Machine Learning with the Parameter Server", OSDI 2014, shard the key space the same way):

* a tensor larger than ``split_bytes`` is cut into ``S`` near-equal flat slices with
  :func:`lightning_par.split.even_bounds`, one per server, so no server carries a big
  layer alone;
* every smaller tensor goes whole to the server with the fewest bytes so far (largest
  first, ties to the lower index), so each server ends with about ``1/S`` of the bytes.

Optimisers that act element by element (SGD, momentum, Adam, AdamW, RMSprop, ...) give the
same result on a slice as on the whole tensor, which is why slicing is exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lightning_par.split import even_bounds


@dataclass(frozen=True)
class Piece:
    """Elements ``start:stop`` of the flattened parameter ``param``, held by ``server``."""

    param: int
    start: int
    stop: int
    server: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class ShardPlan:
    """Every parameter's pieces; ``pieces`` is ordered by parameter, then by start."""

    num_servers: int
    numels: tuple[int, ...]
    element_sizes: tuple[int, ...]
    pieces: tuple[Piece, ...]

    def of_param(self, param: int) -> list[Piece]:
        return [p for p in self.pieces if p.param == param]

    def of_server(self, server: int) -> list[Piece]:
        return [p for p in self.pieces if p.server == server]

    def server_bytes(self) -> list[int]:
        """Bytes of parameters each server holds."""
        total = [0] * self.num_servers
        for p in self.pieces:
            total[p.server] += p.numel * self.element_sizes[p.param]
        return total

    def message(self, params: Sequence[int], server: int) -> list[Piece]:
        """The pieces of ``params`` (e.g. one gradient bucket, in its order) on ``server``:
        the layout of one push and one pull between a worker and that server."""
        return [p for i in params for p in self.of_param(i) if p.server == server]


def plan_shards(
    numels: Sequence[int],
    element_sizes: Sequence[int],
    num_servers: int,
    split_bytes: int = 1 << 20,
) -> ShardPlan:
    """Spread parameters of ``numels`` elements (of ``element_sizes`` bytes) over
    ``num_servers`` servers; tensors above ``split_bytes`` bytes are split over all of them."""
    if num_servers < 1:
        raise ValueError(f"num_servers must be >= 1, got {num_servers}")
    if len(numels) != len(element_sizes):
        raise ValueError("numels and element_sizes must have one entry per parameter")
    if split_bytes < 0:
        raise ValueError(f"split_bytes must be >= 0, got {split_bytes}")
    load = [0] * num_servers
    pieces: list[Piece] = []
    small = []
    for i, (n, size) in enumerate(zip(numels, element_sizes)):
        if n * size > split_bytes and num_servers > 1 and n >= num_servers:
            for server, (start, stop) in enumerate(even_bounds(n, num_servers)):
                pieces.append(Piece(i, start, stop, server))
                load[server] += (stop - start) * size
        else:
            small.append(i)
    for i in sorted(small, key=lambda j: (-numels[j] * element_sizes[j], j)):
        server = min(range(num_servers), key=lambda s: (load[s], s))
        pieces.append(Piece(i, 0, numels[i], server))
        load[server] += numels[i] * element_sizes[i]
    pieces.sort(key=lambda p: (p.param, p.start))
    return ShardPlan(num_servers, tuple(numels), tuple(element_sizes), tuple(pieces))
