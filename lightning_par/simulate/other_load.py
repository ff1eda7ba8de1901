"""Other processes' load beside a measurement: what spoils a calibration trial on a shared
machine, and how much of it a trial may run beside.

A trial of :mod:`.sharing_cost` times ranks taking turns on the cores; other processes that
compute meanwhile slow it as more ranks would (beside one busy core the cost of turns at 4
ranks read 1.40, against 1.03-1.22 quiet). Each trial measures the cores' worth of CPU other
processes took while it ran (:func:`loop_other_load`), and only trials beside less than
:data:`QUIET_LOAD` of it count; :mod:`.base` and :mod:`lightning_par.simulate.validate`
hold measured runs to the same bound.
"""

from __future__ import annotations

#: Cores' worth of other processes' CPU a trial may run beside and still count as quiet.
QUIET_LOAD = 0.25


def loop_other_load(ranks: list[dict]) -> float:
    """Cores' worth of CPU other processes took while ``ranks`` ran (each rank's ``cpu``
    seconds of its process, its ``wall`` seconds, rank 0's reading of the machine's ``busy``
    CPU seconds: the machine's busy time less the ranks' own, as
    :func:`lightning_par.measure.probe.other_load` reads a run's); 0 where the machine's busy
    time is unknown."""
    busy = ranks[0].get("busy")
    if busy is None or ranks[0]["wall"] <= 0:
        return 0.0
    return max(busy - sum(r["cpu"] for r in ranks), 0.0) / ranks[0]["wall"]
