"""Timelines of a real pipeline run: Gantt charts and the measured bubble.

Each stage records ``fwd``/``bwd`` compute spans (zero bubble: ``bwd_input`` and
``bwd_weight``) and one ``step`` span per step (whose ``micro_batch`` field holds the step
index) in its :class:`~lightning_par.comm.CommTrace`,
and the communicator records every message. Times are per process, relative to each
trace's ``origin`` (``time.perf_counter``, one clock for all processes of a machine), so
``origin + t`` puts all stages on one axis.

The measured bubble of a step is the idle share of the stages over the step's window,
``1 - sum(busy time of each stage) / (K * window)``, to compare with GPipe's
``(K - 1) / (M + K - 1)``, which assumes equal stages and free communication.

The formulas also assume textbook step costs (``t_B = 2 t_F``; zero bubble's
``t_F = t_B = t_W``); a CPU stage does not keep them (measured on the CNN: B and W are
not equal halves, the stages of a cut are not equal). :func:`replayed_bubble` evaluates the
schedule with the *measured* cost of every step instead: it replays the step lists (the
validator's :func:`~lightning_par.pipeline.validate.simulate`) with each step's duration
from the trace and free messages. What the measured bubble exceeds the replay by is time
the runtime lost outside compute: messages, the loop's own Python, other processes.
"""

from __future__ import annotations

import json
from pathlib import Path

from lightning_par.comm import CommTrace, Event, Message
from lightning_par.pipeline.schedule import Step
from lightning_par.pipeline.validate import simulate, simulated_bubble

COLOURS = {"fwd": "tab:blue", "bwd": "tab:orange", "bwd_input": "tab:red",
           "bwd_weight": "tab:purple", "send": "tab:green", "recv": "tab:gray"}  # fmt: skip
#: compute spans: forward, whole backward, and zero bubble's input- and weight-gradient halves
COMPUTE = ("fwd", "bwd", "bwd_input", "bwd_weight")
_LETTERS = {"fwd": "F", "bwd": "B", "bwd_input": "B", "bwd_weight": "W"}
_NAMES = {"fwd": "forward (F)", "bwd": "backward (B)", "bwd_input": "input gradient (B)",
          "bwd_weight": "weight gradient (W)", "send": "send: posted → done",
          "recv": "receive: posted → done"}  # fmt: skip


def load_traces(folder: str | Path) -> list[CommTrace]:
    """The traces a strategy with ``trace_dir=folder`` wrote, ordered by rank."""
    traces = []
    for path in sorted(Path(folder).glob("rank*.json"), key=lambda p: int(p.stem[4:])):
        record = json.loads(path.read_text())
        trace = CommTrace(rank=record["rank"], origin=record["origin"])
        trace.messages = [Message(**m) for m in record["messages"]]
        trace.events = [Event(**e) for e in record["events"]]
        traces.append(trace)
    return traces


def step_events(trace: CommTrace, step: int) -> list[Event]:
    """The forward/backward spans one stage ran inside its own ``step`` span."""
    spans = [e for e in trace.events if e.name == "step" and e.micro_batch == step]
    if not spans:
        raise ValueError(f"stage {trace.rank} recorded no step {step}")
    lo, hi = spans[0].start, spans[0].end
    return [e for e in trace.events if e.name in COMPUTE and lo <= e.start and e.end <= hi]


def step_window(traces: list[CommTrace], step: int) -> tuple[float, float]:
    """Absolute (start, end) of ``step``: from its first forward on any stage to its last
    backward on any stage (waiting before the first forward is the previous step's tail)."""
    spans = [(t.origin + e.start, t.origin + e.end) for t in traces for e in step_events(t, step)]
    return min(s for s, _ in spans), max(e for _, e in spans)


def measured_bubble(traces: list[CommTrace], step: int) -> float:
    """Idle fraction of all stages during ``step`` (see the module docstring)."""
    start, end = step_window(traces, step)
    busy = sum(e.end - e.start for t in traces for e in step_events(t, step))
    return 1.0 - busy / (len(traces) * (end - start))


def _durations(traces: list[CommTrace], step: int,
               schedule: list[list[Step]]) -> list[list[float]]:  # fmt: skip
    """Each device's measured step durations, aligned with its step list (a device runs its
    steps in list order, so its compute spans come in that order)."""
    out = []
    for trace, steps in zip(traces, schedule, strict=True):
        events = sorted(step_events(trace, step), key=lambda e: e.start)
        names = [e.name for e in events]
        if names != [s.op for s in steps]:
            raise ValueError(f"stage {trace.rank}'s spans of step {step} ({len(names)}) are not "
                             f"the schedule's {len(steps)} steps in order")  # fmt: skip
        out.append([e.end - e.start for e in events])
    return out


def replayed_bubble(traces: list[CommTrace], step: int, schedule: list[list[Step]],
                    num_stages: int) -> float:  # fmt: skip
    """The bubble ``schedule`` (one step list per device) has when every step costs what it
    cost in ``step`` of the traces and messages are free: the formula's idle time with the
    measured costs instead of the textbook's (see the module docstring)."""
    durations = _durations(traces, step, schedule)
    return simulated_bubble(simulate(schedule, num_stages, durations=durations), len(traces))


def mean_costs(traces: list[CommTrace], step: int) -> dict[str, float]:
    """Mean seconds of one span per compute op (``fwd``, ``bwd``, ``bwd_input``,
    ``bwd_weight``) in ``step``, over every stage and micro-batch."""
    spans: dict[str, list[float]] = {}
    for trace in traces:
        for e in step_events(trace, step):
            spans.setdefault(e.name, []).append(e.end - e.start)
    return {op: sum(v) / len(v) for op, v in spans.items()}


def last_step(traces: list[CommTrace]) -> int:
    return max(e.micro_batch for t in traces for e in t.events if e.name == "step")


def plot_timeline(traces: list[CommTrace], step: int, ax=None, messages: bool = True,
                  legend: bool = True):  # fmt: skip
    """Gantt chart of one step: a row per stage (device), forward (blue), backward
    (orange) or its input-gradient (red) and weight-gradient (purple) halves, labelled with
    their micro-batch; idle time is white (the bubble); with ``messages``, thin bars from
    posting each activation/gradient send (green, above) or receive (grey, below) to its
    completion as the stage observed it (sends are checked at the end of the step). Time 0
    is the step's first forward; a receive posted earlier (stages post them ahead) is drawn
    from 0."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    ax = ax or plt.subplots(figsize=(10, 0.9 + 0.6 * len(traces)))[1]
    start, end = step_window(traces, step)
    for t in traces:
        row = t.rank
        for e in step_events(t, step):
            lo, hi = t.origin + e.start - start, t.origin + e.end - start
            ax.barh(row, (hi - lo) * 1e3, left=lo * 1e3, color=COLOURS[e.name], edgecolor="k",
                    height=0.6)  # fmt: skip
            label = f"{_LETTERS[e.name]}{e.micro_batch}"
            if hi - lo > 0.025 * (end - start):  # label only spans wide enough for it
                ax.text((lo + hi) / 2 * 1e3, row, label, ha="center", va="center", fontsize=9)
        if messages:
            for m in t.messages:
                lo, hi = max(t.origin + m.start - start, 0.0), t.origin + m.end - start
                if m.tag in ("act", "grad") and m.step == step and hi > lo:
                    y = row + (0.36 if m.op == "send" else -0.36)
                    ax.barh(y, (hi - lo) * 1e3, left=lo * 1e3, color=COLOURS[m.op], height=0.1)
    ax.set_yticks(range(len(traces)), [f"stage {t.rank}" for t in traces])
    ax.invert_yaxis()
    ax.set_xlim(0, (end - start) * 1e3 * 1.01)
    ax.set_xlabel("time in step (ms)")
    bubble = measured_bubble(traces, step)
    ax.set_title(f"step {step}: measured bubble {bubble:.0%}")
    if legend:
        ran = {e.name for t in traces for e in step_events(t, step)}
        handles = [Patch(color=COLOURS[k], label=_NAMES[k]) for k in COMPUTE if k in ran]
        if messages:
            handles += [Patch(color=COLOURS[k], label=_NAMES[k]) for k in ("send", "recv")]
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.005, 1), fontsize=10,
                  frameon=False)  # fmt: skip
    return ax
