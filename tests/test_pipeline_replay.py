"""The bubble formula evaluated with measured step costs (:func:`replayed_bubble`): a trace
whose steps ran exactly as the schedule replay says has a measured bubble equal to the
replay, and the replay uses each step's own measured duration, not the textbook costs."""

import pytest

from lightning_par.comm import CommTrace, Event
from lightning_par.pipeline.schedules import device_schedule, formula_bubble
from lightning_par.pipeline.timeline import mean_costs, measured_bubble, replayed_bubble
from lightning_par.pipeline.validate import COSTS, simulate, simulated_bubble

CASES = [("gpipe", 2, 4, 1), ("1f1b", 4, 8, 1), ("interleaved", 2, 4, 2),
         ("interleaved", 4, 8, 2), ("zero_bubble", 2, 8, 1), ("zero_bubble", 4, 4, 1)]  # fmt: skip


def _durations(schedule, costs: dict[str, float], slow: float = 1.0) -> list[list[float]]:
    """Each step's cost, device 0 ``slow`` times slower than the others (an uneven cut)."""
    return [
        [costs[s.op] * (slow if d == 0 else 1.0) for s in lst] for d, lst in enumerate(schedule)
    ]


def _traces(schedule, num_stages: int, durations, gap: float = 0.0):
    """Traces of one step (step 0) that ran as the replay with ``durations`` says, each span
    delayed by ``gap`` per earlier span of its device (time lost outside compute)."""
    traces = [CommTrace(rank=d, origin=0.0) for d in range(len(schedule))]
    seen = [0] * len(schedule)
    timed = simulate(schedule, num_stages, durations=durations)
    for t in sorted(timed, key=lambda t: t.start):
        lost = gap * seen[t.device]
        seen[t.device] += 1
        event = Event(t.device, t.step.op, t.start + lost, t.end + lost, t.step.micro_batch)
        traces[t.device].events.append(event)
    for trace in traces:
        end = max(e.end for e in trace.events)
        trace.events.append(Event(trace.rank, "step", -1.0, end + 1.0, 0))
    return traces


@pytest.mark.parametrize(("schedule", "k", "m", "v"), CASES)
def test_replay_with_textbook_costs_is_the_formula(schedule, k, m, v):
    plan = device_schedule(schedule, k, m, v)
    # the validator's default costs: F = 1, B = 2, B/W = 1
    traces = _traces(plan, k * v, _durations(plan, COSTS))
    assert replayed_bubble(traces, 0, plan, k * v) == pytest.approx(
        formula_bubble(schedule, k, m, v)
    )
    assert measured_bubble(traces, 0) == pytest.approx(formula_bubble(schedule, k, m, v))


@pytest.mark.parametrize(("schedule", "k", "m", "v"), CASES)
def test_replay_uses_the_measured_costs(schedule, k, m, v):
    # W nearly free, B twice F, device 0 1.5x slower: not the formula's costs nor its bubble
    costs = {"fwd": 1.0, "bwd": 2.5, "bwd_input": 2.0, "bwd_weight": 0.5}
    plan = device_schedule(schedule, k, m, v)
    durations = _durations(plan, costs, slow=1.5)
    expected = simulated_bubble(simulate(plan, k * v, durations=durations), k)
    traces = _traces(plan, k * v, durations)
    assert replayed_bubble(traces, 0, plan, k * v) == pytest.approx(expected)
    assert measured_bubble(traces, 0) == pytest.approx(expected)
    assert expected != pytest.approx(formula_bubble(schedule, k, m, v))
    flat = [(s.op, c) for lst, cs in zip(plan, durations) for s, c in zip(lst, cs)]
    mean = {op: sum(c for o, c in flat if o == op) / sum(o == op for o, _ in flat)
            for op, _ in flat}  # fmt: skip
    assert mean_costs(traces, 0) == pytest.approx(mean)
    # time lost between spans shows in the measured bubble, not in the replay
    late = _traces(plan, k * v, durations, gap=0.1)
    assert replayed_bubble(late, 0, plan, k * v) == pytest.approx(expected)
    assert measured_bubble(late, 0) > expected + 0.01


def test_replay_refuses_a_trace_of_another_schedule():
    plan = device_schedule("1f1b", 2, 4)
    other = device_schedule("gpipe", 2, 4)
    traces = _traces(other, 2, _durations(other, COSTS))
    with pytest.raises(ValueError, match="not the schedule's"):
        replayed_bubble(traces, 0, plan, 2)
