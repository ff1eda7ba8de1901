"""Where a training step's time goes: the self time of every profiled action, in buckets.

Lightning's profilers see every hook it calls (``[LightningModule]``, ``[Callback]``,
``[Strategy]`` actions, the data fetch, ``run_training_batch``), but the hooks nest: the
optimiser step runs the closure, which runs ``training_step`` and ``backward``, so
:class:`~lightning.pytorch.profilers.SimpleProfiler`'s durations count the same second
several times. :class:`SelfTimeProfiler` is a Lightning profiler that keeps the stack of
open actions and charges each second to the innermost one (its *self* time), so the
actions add up to the step. The benchmark adds actions of its own (``[bench] <bucket>``):
the network's and the loss's forward, our metric and ``self.log``, the optimiser's own
update (its step hooks), and the plain loop's four phases.

On CUDA it synchronises at every action's start and end (``sync``), so the device's work
is charged to the action that queued it rather than to whichever later call waited: the
profiled step is slower than an unprofiled one, whose host runs ahead of the device, but
every bucket that queues no kernels then measures host time alone, the overhead a small
model's step pays in full.
"""

from __future__ import annotations

import re
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lightning.pytorch.profilers import Profiler
from typing_extensions import override

#: The buckets, in the table's order: key and what it holds.
BUCKETS: dict[str, str] = {
    "data": "data: fetch, crop, flip, normalise",
    "forward": "forward (network and loss)",
    "backward": "backward",
    "optimizer": "optimizer step and zero_grad",
    "metrics_logging": "our metric and self.log",
    "callbacks": "callbacks",
    "module_hooks": "LightningModule hooks, training_step's rest",
    "strategy_hooks": "strategy and precision hooks",
    "loop": "Lightning's loop (the rest)",
}
#: Lightning's action names to buckets, first match wins; unmatched: ``loop``.
RULES: tuple[tuple[str, str], ...] = (
    (r"dataloader_next|batch_to_device|batch_transfer", "data"),
    (r"\.backward$", "backward"),
    (r"optimizer_zero_grad$", "optimizer"),
    (r"^\[Callback\]", "callbacks"),
    (r"^\[Lightning(Data)?Module\]", "module_hooks"),
    (r"^\[Strategy\]", "strategy_hooks"),
)
BENCH = "[bench] "


def bucket_of(action: str) -> str:
    """The bucket an action's self time goes to (``[bench] <bucket>`` names its own)."""
    if action.startswith(BENCH):
        return action[len(BENCH) :]
    return next((b for pattern, b in RULES if re.search(pattern, action)), "loop")


@dataclass
class _Frame:
    action: str
    start: float
    children_s: float = 0.0


class SelfTimeProfiler(Profiler):
    """Self seconds per action between :meth:`begin_window` and :meth:`end_window`.

    Args:
        sync: called at every start and stop before the clock is read (CUDA: wait for the
            device, so its work is charged where it was queued).
    """

    def __init__(self, sync: Callable[[], None] = lambda: None) -> None:
        super().__init__()
        self.sync = sync
        self.self_s: dict[str, float] = defaultdict(float)
        self.window_s = 0.0
        self._stack: list[_Frame] = []
        self._recording = False
        self._window_start = 0.0

    @override
    def start(self, action_name: str) -> None:
        self.sync()
        self._stack.append(_Frame(action_name, time.perf_counter()))

    @override
    def stop(self, action_name: str) -> None:
        self.sync()
        now = time.perf_counter()
        frame = self._stack.pop()
        if frame.action != action_name:
            raise RuntimeError(f"profiler: {action_name!r} stopped inside {frame.action!r}")
        elapsed = now - frame.start
        if self._recording:
            self.self_s[frame.action] += elapsed - frame.children_s
        if self._stack:
            self._stack[-1].children_s += elapsed

    def begin_window(self) -> None:
        """Forget what was recorded; the actions open now count from now on."""
        self.sync()
        now = time.perf_counter()
        self.self_s.clear()
        for frame in self._stack:
            frame.start, frame.children_s = now, 0.0
        self._recording, self._window_start = True, now

    def end_window(self) -> None:
        """Stop recording; the actions still open are charged up to now."""
        self.sync()
        now = time.perf_counter()
        inner = 0.0  # the open frames, innermost first: each one's time less the inner one's
        for frame in reversed(self._stack):
            elapsed = now - frame.start
            self.self_s[frame.action] += elapsed - frame.children_s - inner
            inner = elapsed
        self._recording, self.window_s = False, now - self._window_start

    def buckets_ms(self, steps: int) -> dict[str, float]:
        """Milliseconds per step in each bucket; what no action holds goes to ``loop``."""
        out = dict.fromkeys(BUCKETS, 0.0)
        for action, seconds in self.self_s.items():
            out[bucket_of(action)] += seconds
        out["loop"] += self.window_s - sum(self.self_s.values())
        return {bucket: 1e3 * seconds / steps for bucket, seconds in out.items()}

    def top_actions_ms(self, steps: int, count: int = 12) -> list[dict[str, Any]]:
        """The ``count`` actions with the most self time, milliseconds per step."""
        ranked = sorted(self.self_s.items(), key=lambda kv: -kv[1])[:count]
        return [{"action": a, "bucket": bucket_of(a), "self_ms": 1e3 * s / steps}
                for a, s in ranked]  # fmt: skip


def profile_method(owner: Any, name: str, profiler: Profiler, bucket: str) -> None:
    """Charge every call of ``owner.name`` (a bound method) to ``[bench] <bucket>``."""
    method = getattr(owner, name)

    def profiled(*args: Any, **kwargs: Any) -> Any:
        with profiler.profile(BENCH + bucket):
            return method(*args, **kwargs)

    setattr(owner, name, profiled)  # (an instance attribute: the class is left alone)
