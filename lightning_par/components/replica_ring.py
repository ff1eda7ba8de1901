"""Local SGD's replicas kept past a lost process: each one's state also held by a neighbour.

Between two averagings a local-SGD replica's progress, and at all times its optimiser
state, exist only in the process that trains it (:mod:`lightning_par.strategies.local_sgd`).
To go on without a lost process and still end with the weights the run would have had
without the fault, every replica is kept twice, as Gemini keeps in-memory checkpoints on
peers (Wang et al., "GEMINI: Fast Failure Recovery in Distributed Training with In-Memory
Checkpoints", SOSP 2023) and Bamboo has a neighbour redo the work of a lost node (Thorpe et
al., "Bamboo: Making Preemptible Instances Resilient for Affordable Training of Large
DNNs", NSDI 2023):

* at each averaging every member keeps the averaged tensors (the *base*, the same in every
  replica) and receives from its left neighbour in the ring of members the rest of each
  replica that neighbour trains (:class:`ReplicaState`: optimiser state, the tensors an
  averaging leaves alone, the random state): one point-to-point message of about the
  optimiser state's size per averaging (:func:`pass_right`);
* when members are lost, each replica they trained goes to the member holding its state
  (:func:`next_hosts`): a :class:`StandIn` made of the base and that state replays the lost
  member's steps since the averaging (:class:`StepRecord`: which batch, which
  hyperparameters, which random state) and then trains every step beside its host's own
  replica, in the module's own parameters (:meth:`StandIn.installed` swaps their storage),
  with an optimiser of the user's class holding its state (:func:`stand_in_optimizer`);
* an averaging sums every replica a member trains and divides by the replicas of the first
  world (:func:`~lightning_par.collectives.averaging.replica_mean`): the mean of the run
  without the fault, to float rounding.

A replica is lost for good only when the member training it and the one holding its state
are both lost between two averagings (:class:`ReplicaLost`).
"""

from __future__ import annotations

import copy
import io
from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_par.comm import Communicator

#: A process's random state: ``cpu`` and, computing on a GPU, that device's (``cuda``).
RandomState = dict[str, torch.Tensor]


class ReplicaLost(RuntimeError):
    """The member training a replica and the neighbour holding its state were both lost."""


# ---- what a replica is made of ----------------------------------------------------------------
class ReplicaLayout:
    """A replica's tensors: every parameter and buffer of ``module`` (a shared one once), in
    one order, split into those an averaging averages (``averaged``, positions) and those
    it leaves alone (``kept``: integer buffers, buffers not averaged)."""

    def __init__(self, module: nn.Module, averaged: Sequence[torch.Tensor]) -> None:
        self.tensors: list[torch.Tensor] = []
        seen: set[int] = set()
        for t in [*module.parameters(), *module.buffers()]:
            if id(t) not in seen:
                seen.add(id(t))
                self.tensors.append(t)
        ids = {id(t) for t in averaged}
        self.averaged = [i for i, t in enumerate(self.tensors) if id(t) in ids]
        self.kept = [i for i, t in enumerate(self.tensors) if id(t) not in ids]

    @staticmethod
    def pick(tensors: Sequence[torch.Tensor], positions: list[int]) -> list[torch.Tensor]:
        return [tensors[i] for i in positions]


@dataclass
class ReplicaState:
    """What a replica holds besides the averaged tensors."""

    optimizer: dict[str, Any]  # its optimiser's ``state_dict()``
    kept: list[torch.Tensor]  # the tensors an averaging leaves alone (``ReplicaLayout.kept``)
    random: RandomState | None  # its random state; None: the same as its host's


@dataclass
class StepRecord:
    """One optimiser step since the last averaging, as a stand-in replays it: the batch
    (``epoch``, ``batch_idx``), the hyperparameters of each parameter group, and the random
    state the host's own step began with."""

    epoch: int
    batch_idx: int
    hyperparameters: list[dict[str, Any]]
    random: RandomState


# ---- passing states round the ring ------------------------------------------------------------
def encode_states(states: dict[int, ReplicaState]) -> torch.Tensor:
    """``states`` (replica -> state) as bytes in a ``uint8`` tensor (``torch.save``)."""
    buffer = io.BytesIO()
    torch.save({m: vars(s) for m, s in states.items()}, buffer)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def decode_states(payload: torch.Tensor) -> dict[int, ReplicaState]:
    """What :func:`encode_states` wrote; tensors, numbers, strings and containers only
    (``weights_only``): no code runs from a peer's bytes."""
    data = io.BytesIO(payload.cpu().numpy().tobytes())
    raw = torch.load(data, map_location="cpu", weights_only=True)
    return {m: ReplicaState(**fields) for m, fields in raw.items()}


def pass_right(comm: Communicator, payload: torch.Tensor) -> torch.Tensor:
    """Send ``payload`` (bytes) to the next rank of ``comm``'s ring and return the previous
    rank's (a lone rank is its own neighbour)."""
    n, rank = comm.world_size, comm.rank
    if n == 1:
        return payload
    right, left = (rank + 1) % n, (rank - 1) % n
    size = torch.tensor([payload.numel()], dtype=torch.int64, device=payload.device)
    got = torch.empty(1, dtype=torch.int64, device=payload.device)
    comm.sendrecv(size, right, got, left, tag="replica-size")
    received = torch.empty(int(got.item()), dtype=torch.uint8, device=payload.device)
    return comm.sendrecv(payload, right, received, left, tag="replica-state")


def next_hosts(
    hosted: dict[int, list[int]], ring: list[int], alive: list[int]
) -> dict[int, list[int]]:
    """Which replicas each member in ``alive`` trains: ``hosted[m]``, the replicas member
    ``m`` trained at the last averaging, where ``ring`` were the members; a lost member's
    go to its right neighbour in ``ring``, which received their state then."""
    hosts = {m: list(hosted[m]) for m in alive}
    for i, member in enumerate(ring):
        if member in alive:
            continue
        holder = ring[(i + 1) % len(ring)]
        if holder not in alive:
            raise ReplicaLost(
                f"local_sgd(fault_tolerant=True) cannot go on: ranks {member} and {holder} "
                f"were both lost between two averagings, and rank {holder} held the only "
                f"other copy of the replica(s) {hosted[member]} rank {member} trained. Average "
                "more often (a smaller period), or resume from a checkpoint"
            )
        hosts[holder] = sorted(hosts[holder] + hosted[member])
    return hosts


# ---- a replica trained in another member's place ------------------------------------------------
def random_state(device: torch.device) -> RandomState:
    """This process's random state (CPU, and ``device``'s if it is a GPU)."""
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_random_state(state: RandomState, device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def same_random_state(a: RandomState, b: RandomState) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@contextmanager
def kept_random_state(device: torch.device) -> Iterator[None]:
    """What runs inside moves none of this process's random streams."""
    state = random_state(device)
    try:
        yield
    finally:
        set_random_state(state, device)


def hyperparameters(optimizer: Optimizer) -> list[dict[str, Any]]:
    """Each parameter group's hyperparameters (all but its parameters), copied."""
    return [
        {k: copy.deepcopy(v) for k, v in group.items() if k != "params"}
        for group in optimizer.param_groups
    ]


def stand_in_optimizer(optimizer: Optimizer, state: dict[str, Any]) -> Optimizer:
    """An optimiser of ``optimizer``'s class over the same parameters (whose storage a
    stand-in swaps in), holding ``state``: the user's optimiser's attributes (its hooks)
    shared, its state and parameter groups its own. No constructor is called: the user's
    class may take any arguments. Methods set on the instance are left out: an LR
    scheduler's wrapper of ``step`` would step the user's optimiser."""
    twin = object.__new__(type(optimizer))
    twin.__dict__.update({k: v for k, v in optimizer.__dict__.items() if not callable(v)})
    twin.state = defaultdict(dict)
    twin.param_groups = [dict(group) for group in optimizer.param_groups]
    twin.load_state_dict(state)
    return twin


class StandIn:
    """Member ``member``'s replica, trained by another member after ``member`` was lost
    (module docstring): its ``tensors`` (in :class:`ReplicaLayout` order), its optimiser
    and its random state (None: its host's, which was equal at the last averaging)."""

    def __init__(
        self, member: int, tensors: list[torch.Tensor], optimizer: Optimizer,
        random: RandomState | None,
    ) -> None:  # fmt: skip
        self.member, self.tensors, self.optimizer, self.random = member, tensors, optimizer, random
        #: the steps since the last averaging it has trained (it catches up with its host)
        self.trained = 0

    @classmethod
    def build(
        cls, member: int, layout: ReplicaLayout, base: Sequence[torch.Tensor],
        state: ReplicaState, optimizer: Optimizer,
    ) -> StandIn:  # fmt: skip
        """The replica as it was at the last averaging: ``base`` and its ``state``."""
        tensors: list[torch.Tensor] = [torch.empty(0)] * len(layout.tensors)
        for i, t in zip(layout.averaged, base):
            tensors[i] = t.detach().clone()
        for i, t in zip(layout.kept, state.kept):
            tensors[i] = t.to(layout.tensors[i].device).clone()
        twin = stand_in_optimizer(optimizer, state.optimizer)
        return cls(member, tensors, twin, state.random)

    def state(self, layout: ReplicaLayout, host_random: RandomState) -> ReplicaState:
        """What its neighbour keeps of it at an averaging."""
        return ReplicaState(
            self.optimizer.state_dict(),
            layout.pick(self.tensors, layout.kept),
            self.random if self.random is not None else host_random,
        )

    @contextmanager
    def installed(
        self, module_tensors: Sequence[torch.Tensor], host_stream: RandomState,
        device: torch.device,
    ) -> Iterator[None]:  # fmt: skip
        """Inside, the module computes with this replica: its tensors' storage, no
        gradients, its random state (``host_stream``, the state the host's own step began
        with, when it follows its host's); after, the host's come back and the replica keeps
        what was done to it."""
        own = [(t.data, t.grad) for t in module_tensors]
        host = random_state(device)
        for t, mine in zip(module_tensors, self.tensors):
            t.data, t.grad = mine, None
        set_random_state(self.random if self.random is not None else host_stream, device)
        try:
            yield
        finally:
            self.tensors = [t.data for t in module_tensors]
            if self.random is not None:
                self.random = random_state(device)
            for t, (data, grad) in zip(module_tensors, own):
                t.data, t.grad = data, grad
            set_random_state(host, device)
