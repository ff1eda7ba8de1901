"""Hybrid parallelism as plain modules (no Lightning): the ``dp × mp`` grid of ranks and its
process groups (:mod:`.grid`). The Lightning adapter is
:class:`lightning_par.strategies.hybrid.HybridStrategy`."""

from lightning_par.hybrid.grid import (
    DEFAULT_MP,
    Grid,
    GridGroups,
    check_degrees,
    create_groups,
    make_grid,
    talk_groups,
)

__all__ = [
    "DEFAULT_MP",
    "Grid",
    "GridGroups",
    "check_degrees",
    "create_groups",
    "make_grid",
    "talk_groups",
]
