"""Link classes for the simulator: a latency ``alpha`` (s) and a time per byte ``beta``.

Sending ``m`` bytes over a link costs ``alpha + beta * m`` (Hockney, "The communication
challenge for MPP", Parallel Computing 20(3), 1994), the model of
:mod:`lightning_par.collectives.cost_model`. Bandwidths are **per direction** and nominal
(what the datasheet promises; achieved bus bandwidth in nccl-tests is typically 70-90 % of
it, see NVIDIA nccl-tests ``doc/PERFORMANCE.md``). Latencies are small-message figures of the
order those sources report; they are assumptions, stated so that a reader can change them.

=========  ======================================  ========  ===============================
name       what                                    alpha     beta (1 / bandwidth)
=========  ======================================  ========  ===============================
loopback   this machine's gloo over TCP loopback   fitted    fitted (:func:`fit_link`)
pcie       PCIe 4.0 x16 between GPUs, host hop     10 us     1 / 32 GB/s (PCI-SIG 4.0: 16
                                                             GT/s x 16 lanes, 128b/130b)
nvlink     NVLink 4 (H100 SXM): 900 GB/s total     2 us      1 / 450 GB/s (NVIDIA H100
           per GPU = 450 GB/s each way                       datasheet, 18 links x 25 GB/s)
eth100     100 Gb/s Ethernet, TCP                  25 us     1 / 12.5 GB/s (IEEE 802.3ba)
ib         InfiniBand NDR 400 Gb/s, one NIC per    5 us      1 / 50 GB/s (NVIDIA ConnectX-7
           GPU (as in a DGX H100)                            / Quantum-2 NDR datasheets)
=========  ======================================  ========  ===============================

A :class:`Topology` names the link inside a node and between nodes (``"nvlink+ib"``: 8
GPUs per node on NVLink, nodes on InfiniBand; ``"pcie"``: one link class everywhere).
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from lightning_par.collectives.cost_model import fit_alpha_beta

if TYPE_CHECKING:
    from lightning_par.simulate.ops import Graph


@dataclass(frozen=True)
class Link:
    """One link class: ``alpha`` seconds per message, ``beta`` seconds per byte."""

    name: str
    alpha: float
    beta: float
    source: str = ""
    #: Transfers at once on one such link share its bandwidth (see ``engine.contention``).
    shared: bool = False

    def time(self, nbytes: float) -> float:
        return self.alpha + self.beta * nbytes

    @property
    def gbytes_per_s(self) -> float:
        return 1e-9 / self.beta if self.beta > 0 else float("inf")


GB = 1e9
PRESETS: dict[str, Link] = {
    # loopback's default stands in until fit_link measures this machine (see the docs)
    "loopback": Link("loopback", 60e-6, 1 / (1.0 * GB), "fitted on this machine (fit_link)"),
    "pcie": Link("pcie", 10e-6, 1 / (32 * GB),
                 "PCI-SIG PCIe 4.0 base spec: 16 GT/s x16, 128b/130b, ~32 GB/s each way"),
    "nvlink": Link("nvlink", 2e-6, 1 / (450 * GB),
                   "NVIDIA H100 SXM datasheet: NVLink 4, 900 GB/s per GPU = 450 GB/s each way"),
    "eth100": Link("eth100", 25e-6, 1 / (12.5 * GB),
                   "IEEE 802.3ba 100 Gb/s Ethernet = 12.5 GB/s each way; TCP latency assumed"),
    "ib": Link("ib", 5e-6, 1 / (50 * GB),
               "NVIDIA ConnectX-7 / Quantum-2 NDR datasheet: 400 Gb/s = 50 GB/s each way"),
}  # fmt: skip


@dataclass(frozen=True)
class Topology:
    """``intra`` links ranks of one node (``per_node`` ranks each), ``inter`` links nodes."""

    intra: Link
    inter: Link
    per_node: int = 8

    def link(self, src: int, dst: int) -> Link:
        same = src // self.per_node == dst // self.per_node
        return self.intra if same else self.inter

    def slowest(self, world: int) -> Link:
        """The link a collective spanning ``world`` ranks is bound by."""
        return self.intra if world <= self.per_node else self.inter

    @property
    def name(self) -> str:
        same = self.intra.name == self.inter.name
        return self.intra.name if same else f"{self.intra.name}+{self.inter.name}"


def parse_topology(spec: str, per_node: int = 8, loopback: Link | None = None) -> Topology:
    """``"nvlink+ib"`` (intra + inter) or one preset name for both."""
    names = spec.split("+")
    if len(names) > 2 or not all(names):
        raise ValueError(f"link {spec!r}: give one preset or two joined by '+', e.g. nvlink+ib")
    links = []
    for name in names:
        if name not in PRESETS:
            raise ValueError(f"unknown link preset {name!r}; choose from {', '.join(PRESETS)}")
        links.append(loopback if name == "loopback" and loopback is not None else PRESETS[name])
    return Topology(links[0], links[-1], per_node)


def fit_link(samples: list[tuple[int, float]], name: str = "loopback") -> Link:
    """A link fitted by :func:`~lightning_par.collectives.cost_model.fit_alpha_beta` to
    ``(nbytes, seconds)`` transfer times (e.g. :func:`~.graph.transfer_samples` of a trace).
    With fewer than two sizes the preset's beta is kept and alpha is the mean rest."""
    sizes = {n for n, _ in samples}
    if len(sizes) >= 2:
        alpha, beta = fit_alpha_beta([n for n, _ in samples], [s for _, s in samples])
    else:
        beta = PRESETS["loopback"].beta
        alpha = max(0.0, sum(s - beta * n for n, s in samples) / max(len(samples), 1))
    return replace(PRESETS["loopback"], name=name, alpha=alpha, beta=beta,
                   source=f"fitted to {len(samples)} traced transfers on this machine")  # fmt: skip


def transfers_at_once(graph: Graph, topo: Topology,
                      transfers: dict[int, tuple[float, float]]) -> dict[int, float]:  # fmt: skip
    """Most transfers at once on either end of each transfer over a shared link."""
    ports: dict[tuple[int, str], list[int]] = defaultdict(list)
    for i, m in enumerate(graph.messages):
        link = topo.link(m.src, m.dst)
        if link.shared and i in transfers:
            ports[(m.src, link.name)].append(i)
            ports[(m.dst, link.name)].append(i)
    share: dict[int, float] = {}
    for users in ports.values():
        # transfers at once just after each start (a sweep over the sorted starts and ends)
        starts = sorted(transfers[i][0] for i in users)
        ends = sorted(transfers[i][1] for i in users)
        level = [bisect.bisect_right(starts, x) - bisect.bisect_right(ends, x) for x in starts]
        for i in users:
            a, b = transfers[i]
            lo, hi = bisect.bisect_left(starts, a), bisect.bisect_left(starts, b)
            most = max(level[lo:hi], default=1)
            share[i] = max(share.get(i, 1.0), float(most))
    return share
