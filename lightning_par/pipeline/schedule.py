"""Pipeline schedules as explicit step lists: what each stage does, in which order.

A schedule is, for each stage, the ordered list of :class:`Step` (stage, op, micro-batch)
it executes; a stage forwards micro-batch ``i`` once the previous stage sent its
activation, and runs its backward once the next stage sent the gradient. The lists can be
printed and checked without any process; :func:`unit_time_table` replays them on an ideal
machine (every step takes one time slot, messages are free) to draw the textbook diagrams.
The schedules by name, with what else each knows: :mod:`.schedules`.

* **GPipe** (Huang et al., 2019, figure 2): every stage runs all M forwards, then all M
  backwards in reverse order. Idle fraction per stage (the bubble): (K-1)/(M+K-1).
* **1F1B** (PipeDream-flush; Narayanan et al., 2021, "Memory-Efficient Pipeline-Parallel
  DNN Training", figure 4): stage s runs ``K - s - 1`` warm-up forwards, then alternates one
  forward and one backward, then drains the remaining backwards. Same bubble as GPipe, but
  a stage holds at most ``K - s`` micro-batches' activations instead of M.
"""

from __future__ import annotations

from typing import NamedTuple


class Step(NamedTuple):
    stage: int
    op: str  # "fwd", "bwd"; zero bubble splits "bwd" into "bwd_input" and "bwd_weight"
    micro_batch: int

    def __str__(self) -> str:
        return f"{_LETTERS.get(self.op, '?')}{self.micro_batch}"

    def describe(self) -> str:
        """In words, for error messages: ``"forward of micro-batch 3 on stage 2"``."""
        what = _WORDS.get(self.op, repr(self.op))
        return f"{what} of micro-batch {self.micro_batch} on stage {self.stage}"


# the zero-bubble paper's letters: B is the input-gradient half, W the weight-gradient half
_LETTERS = {"fwd": "F", "bwd": "B", "bwd_input": "B", "bwd_weight": "W"}
_WORDS = {"fwd": "forward", "bwd": "backward", "bwd_input": "input-gradient backward (B)",
          "bwd_weight": "weight-gradient backward (W)"}  # fmt: skip


def _check(num_stages: int, chunks: int) -> None:
    if num_stages < 1 or chunks < 1:
        raise ValueError(f"need >= 1 stage and >= 1 micro-batch, got {num_stages}, {chunks}")


def gpipe_steps(stage: int, num_stages: int, chunks: int) -> list[Step]:
    """GPipe: F0..F(M-1), then B(M-1)..B0 (backward in reverse, as autograd would)."""
    _check(num_stages, chunks)
    forwards = [Step(stage, "fwd", i) for i in range(chunks)]
    return forwards + [Step(stage, "bwd", i) for i in reversed(range(chunks))]


def one_f_one_b_steps(stage: int, num_stages: int, chunks: int) -> list[Step]:
    """1F1B (PipeDream-flush): warm-up forwards, steady one-forward-one-backward, drain."""
    _check(num_stages, chunks)
    warmup = min(num_stages - stage - 1, chunks)
    steps = [Step(stage, "fwd", i) for i in range(warmup)]
    for i in range(chunks - warmup):
        steps += [Step(stage, "fwd", warmup + i), Step(stage, "bwd", i)]
    steps += [Step(stage, "bwd", i) for i in range(chunks - warmup, chunks)]
    return steps


def unit_time_table(per_stage: list[list[Step]]) -> list[list[Step | None]]:
    """Replay one step list per stage (whole backwards) with unit-time steps: ``table[t][s]``
    is what stage ``s`` does in time slot ``t`` (``None``: idle). Forward of micro-batch i on
    stage s waits for stage s-1's forward of i; its backward waits for stage s+1's backward
    of i (or, on the last stage, for its own forward)."""
    num_stages = len(per_stage)
    done: dict[Step, int] = {}  # step -> slot it ran in
    position = [0] * num_stages
    table: list[list[Step | None]] = []
    while any(position[s] < len(per_stage[s]) for s in range(num_stages)):
        row: list[Step | None] = [None] * num_stages
        for s in range(num_stages):
            if position[s] == len(per_stage[s]):
                continue
            step = per_stage[s][position[s]]
            if step.op == "fwd":
                dep = Step(s - 1, "fwd", step.micro_batch) if s > 0 else None
            elif s == num_stages - 1:
                dep = Step(s, "fwd", step.micro_batch)
            else:
                dep = Step(s + 1, "bwd", step.micro_batch)
            if dep is None or done.get(dep, len(table)) < len(table):
                row[s] = step
        if all(step is None for step in row):
            raise RuntimeError(f"these step lists deadlock at slot {len(table)}")
        for s, step in enumerate(row):
            if step is not None:
                done[step] = len(table)
                position[s] += 1
        table.append(row)
    return table


def format_table(table: list[list[Step | None]]) -> str:
    """One line per stage, one column per time slot (``..`` idle), as in the papers' figures."""
    lines = []
    for s in range(len(table[0]) if table else 0):
        cells = [f"{str(row[s]) if row[s] is not None else '..':>4}" for row in table]
        lines.append(f"stage {s}:" + "".join(cells))
    return "\n".join(lines)


def bubble_fraction(num_stages: int, chunks: int) -> float:
    """GPipe's idle fraction (K-1)/(M+K-1) with equal forward/backward cost per stage."""
    _check(num_stages, chunks)
    return (num_stages - 1) / (chunks + num_stages - 1)


def max_in_flight(steps: list[Step]) -> int:
    """Most micro-batches whose forward ran but whose backward has not (activations held)."""
    live = peak = 0
    for step in steps:
        live += 1 if step.op == "fwd" else -1
        peak = max(peak, live)
    return peak
