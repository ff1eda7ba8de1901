"""One data-parallel step predicted by the simulator, to check a prediction made by hand.

The exercise: a step of ``compute_s`` seconds of forward and backward on every device, then
one allreduce of the gradients (``grad_bytes``) over ``devices`` ranks on a link of latency
``alpha`` and time per byte ``beta``. By hand, with the ring (Patarasuk and Yuan, "Bandwidth
optimal all-reduce algorithms for clusters of workstations", JPDC 69(2), 2009; Hockney's
``alpha + beta * m`` per message)::

    step = compute_s + 2 (p - 1) * (alpha + beta * grad_bytes / p)

(``grad_bytes / p`` rounded up to whole float32 elements). :func:`predict_step` builds the
same step as the scale-out does (:func:`.builders.data_parallel_graph`) and replays it in the
engine; :func:`step_parts` gives the terms, so a wrong guess shows which term was wrong.
With ``backward_s`` and ``buckets`` the allreduce overlaps backward, as in
:mod:`lightning_par.comm.buckets`; the formula above is then only an upper bound.
"""

from __future__ import annotations

from lightning_par.collectives.cost_model import predict
from lightning_par.simulate.links import PRESETS, Link, Topology
from lightning_par.simulate.profile import Profile
from lightning_par.simulate.scale import predict_step as scaled


def _link(link: str | Link) -> Link:
    if isinstance(link, Link):
        return link
    if link not in PRESETS:
        raise ValueError(f"link {link!r} is not one of {sorted(PRESETS)} (or pass a Link)")
    return PRESETS[link]


def _profile(compute_s: float, grad_bytes: int, devices: int, algorithm: str,
             backward_s: float, buckets: int) -> Profile:  # fmt: skip
    if compute_s < 0 or grad_bytes < 0 or devices < 1 or buckets < 1:
        raise ValueError("compute_s and grad_bytes must be >= 0, devices and buckets >= 1")
    if not 0 <= backward_s <= compute_s:
        raise ValueError(f"backward_s must be between 0 and compute_s, got {backward_s}")
    return Profile(f"{algorithm}_allreduce", "allreduce", devices, devices, devices, 0.0,
                   compute_s, algorithm=algorithm, grad_bytes=grad_bytes,
                   backward_s=backward_s, batch_s=compute_s, buckets=buckets)  # fmt: skip


def predict_step(compute_s: float, grad_bytes: int, devices: int, link: str | Link = "nvlink",
                 algorithm: str = "ring", backward_s: float = 0.0,
                 buckets: int = 1) -> float:  # fmt: skip
    """Seconds of one data-parallel step, as the simulator predicts it (see the module
    docstring). ``link``: a preset name (``"nvlink"``, ``"ib"``, ...) or a :class:`Link`."""

    own = _link(link)
    prof = _profile(compute_s, grad_bytes, devices, algorithm, backward_s, buckets)
    return scaled(prof, devices, Topology(own, own))


def step_parts(compute_s: float, grad_bytes: int, devices: int, link: str | Link = "nvlink",
               algorithm: str = "ring") -> dict[str, float]:  # fmt: skip
    """The terms of the hand formula (no overlap): ``messages`` on the critical path,
    ``bytes_per_message`` of the largest, ``latency_s``, ``bandwidth_s``, ``compute_s`` and
    their sum ``step_s`` (equal to :func:`predict_step` with no ``backward_s``)."""
    own = _link(link)
    _profile(compute_s, grad_bytes, devices, algorithm, 0.0, 1)
    cost = predict(algorithm, max(grad_bytes // 4, 1), devices)
    latency, bandwidth = cost.latency_terms * own.alpha, cost.bandwidth_bytes * own.beta
    per = cost.bandwidth_bytes / cost.latency_terms if cost.latency_terms else 0.0
    return {"messages": cost.latency_terms, "bytes_per_message": per, "latency_s": latency,
            "bandwidth_s": bandwidth, "compute_s": compute_s,
            "step_s": compute_s + latency + bandwidth}  # fmt: skip
