"""The costs every step graph of :mod:`.builders` shares: a collective's time on the slowest
link the ranks span (:func:`allreduce_s`, :func:`ring_phase_s`), a data-parallel rank's
compute at ``p`` over the measured one (:func:`sample_scale`, :func:`batch_share`) and the
CPU a rank spends moving its messages where ranks share cores (:func:`communication_cpu`).
"""

from __future__ import annotations

from lightning_par.collectives.cost_model import predict
from lightning_par.simulate.links import Topology
from lightning_par.simulate.profile import Profile
from lightning_par.tensorparallel.cost import all_gather_cost


def allreduce_s(algorithm: str, nbytes: int, p: int, topo: Topology) -> float:
    """One allreduce of ``nbytes`` by ``algorithm`` on the slowest link ``p`` ranks span."""
    link = topo.slowest(p)
    return predict(algorithm, max(nbytes // 4, 1), p).time(link.alpha, link.beta)


def ring_phase_s(nbytes: int, p: int, topo: Topology) -> float:
    """One reduce-scatter or all-gather of ``nbytes`` on the ring of ``p`` ranks."""
    link = topo.slowest(p)
    return all_gather_cost([max(nbytes // 4 // p, 1)] * p).time(link.alpha, link.beta)


def sample_scale(prof: Profile, p: int) -> float:
    """A data-parallel rank's per-sample work at ``p`` over at the measured size: its batch,
    ``world / p`` of the measured, or, where the model's step was timed on both batches on
    this machine (:attr:`~.profile.Profile.sample_scale`), that step's ratio."""
    return prof.sample_scale.get(p, prof.world / p)


def batch_share(prof: Profile, p: int, weak: bool) -> float:
    """Data-parallel compute at ``p`` over the measured: the per-sample part
    (:attr:`~.profile.Profile.batch_s`) scales by :func:`sample_scale` at a fixed global
    batch (strong scaling), by 1 at a fixed batch per device (weak scaling); the per-step
    part stays."""
    if weak or not prof.compute_s:
        return 1.0
    fixed = prof.compute_s - prof.batch_s
    return (fixed + prof.batch_s * sample_scale(prof, p)) / prof.compute_s


def communication_cpu(prof: Profile, cores: int | None) -> float:
    """CPU seconds per step a rank spends moving its messages beyond its main thread (gloo's
    threads, the bucket thread: :attr:`~.profile.Profile.comm_cpu_s`, measured), where the
    ranks share ``cores`` of this machine (``None``: other hardware, where the link's cost
    says it all). Measured on 2 to 4 ranks of the allreduce family it barely follows the
    bytes a rank sends (a ring at 4 ranks sends 1.5 times the bytes of 2, and spent 1.85
    against 2.05 ms), so it is carried as measured."""
    return prof.comm_cpu_s if cores is not None else 0.0
