"""Tables and figures of the simulator: Gantt charts (measured beside simulated), scaling.

The Gantt charts follow :func:`lightning_par.pipeline.timeline.plot_timeline`: one row per
rank, milliseconds on x, one colour per kind of time, a legend. A background lane (the
communication thread) is drawn as a thin bar under its rank's row.
"""

from __future__ import annotations

from pathlib import Path

from lightning_par.simulate.engine import Result, Span
from lightning_par.simulate.ops import Graph, Join, Wait

KIND_COLOURS = {"compute": "tab:blue", "communication": "tab:green", "waiting": "tab:red",
                "blocked": "tab:olive"}  # fmt: skip


def measured_spans(graph: Graph) -> list[Span]:
    """The main lanes' ops where they ran in the measured run (blocked: comm + waiting)."""
    origin = min(graph.start.values(), default=0.0)
    base = min((iv[0][0] for iv in graph.measured.values() if iv), default=0.0)
    spans = []
    for lane, intervals in graph.measured.items():
        for op, (a, b) in zip(graph.lanes[lane], intervals):
            kind = "blocked" if isinstance(op, (Wait, Join)) else "compute"
            if b > a:
                spans.append(Span(lane, a - base + origin, b - base + origin, kind))
    return spans


def gantt(ax, spans: list[Span], title: str) -> None:
    """Draw ``spans`` on ``ax``: rank rows, ms on x."""
    from matplotlib.patches import Patch

    t0 = min((s.start for s in spans), default=0.0)
    for s in spans:
        thin = s.lane[1] != "main"
        y = s.lane[0] + (0.32 if thin else 0.0)
        ax.barh(y, (s.end - s.start) * 1e3, left=(s.start - t0) * 1e3, height=0.15 if thin
                else 0.6, color=KIND_COLOURS[s.kind], edgecolor="none")  # fmt: skip
    ranks = sorted({s.lane[0] for s in spans})
    ax.set_yticks(ranks, [f"rank {r}" for r in ranks])
    if not ax.yaxis_inverted():  # shared y axes: invert once
        ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    ax.set_title(title, fontsize=9)
    kinds = [k for k in KIND_COLOURS if any(s.kind == k for s in spans)]
    ax.legend(handles=[Patch(color=KIND_COLOURS[k], label=k) for k in kinds], fontsize=7,
              loc="lower right")  # fmt: skip


def _save(fig, path: str | Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def side_by_side(graph: Graph, result: Result, path: str | Path, what_if: str) -> Path:
    """Measured (left) and simulated (right) Gantt charts of one graph, saved to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 1.2 + 0.6 * len(graph.ranks)),
                                      sharey=True)  # fmt: skip
    gantt(left, measured_spans(graph), "measured on this machine")
    gantt(right, result.spans, f"simulated: {what_if}")
    return _save(fig, path)


def scaling_figure(rows: list[dict], path: str | Path, assumptions: str) -> Path:
    """Predicted throughput and scaling efficiency against devices, one line per strategy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name in dict.fromkeys(r["strategy"] for r in rows):
        mine = [r for r in rows if r["strategy"] == name and r["step_s"] is not None]
        if not mine:
            continue
        x = [r["devices"] for r in mine]
        left.plot(x, [r["images_per_s"] for r in mine], marker=".", label=name)
        right.plot(x, [r["efficiency"] for r in mine], marker=".", label=name)
    for ax, label in ((left, "images / s (predicted)"), (right, "scaling efficiency (predicted)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("devices")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    left.set_yscale("log")
    right.legend(fontsize=7)
    fig.suptitle(f"PREDICTED by lightning_par.simulate, not measured: {assumptions}", fontsize=9)
    return _save(fig, path)


def _fmt(x: float | None, scale: float = 1.0, digits: int = 1) -> str:
    return "-" if x is None else f"{x * scale:.{digits}f}"


#: Under a scaling table whose rows have model state per rank.
MEMORY_NOTE = ("State MB/rank: parameters, gradients and optimizer state per rank from ZeRO's "
               "formulas (lightning_par.simulate.memory), not simulated; the other strategies' "
               "memory is not modelled.")  # fmt: skip


def scaling_table(rows: list[dict]) -> str:
    """Markdown: one row per strategy, step ms / images/s / efficiency per device count, and
    the model state per rank where a formula gives it (then :data:`MEMORY_NOTE` under it)."""
    sizes = sorted({r["devices"] for r in rows})
    head = "| strategy | " + " | ".join(f"{p} dev: step ms, img/s, eff" for p in sizes) + " |"
    lines = [head, "|---" * (len(sizes) + 1) + "|"]
    for name in dict.fromkeys(r["strategy"] for r in rows):
        cells = []
        for p in sizes:
            r = next(r for r in rows if r["strategy"] == name and r["devices"] == p)
            if r["step_s"] is None:
                cells.append(f"n/a ({r['note']})")
            else:
                cells.append(f"{_fmt(r['step_s'], 1e3, 2)}, {r['images_per_s']:,.0f}, "
                             f"{r['efficiency']:.0%}")  # fmt: skip
            if r.get("state_bytes") is not None:
                cells[-1] += f"; state {r['state_bytes'] / 2**20:.3g} MB/rank"
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    if any(r.get("state_bytes") is not None for r in rows):
        lines += ["", MEMORY_NOTE]
    return "\n".join(lines)


def validation_table(rows: list[dict]) -> str:
    """Measured against predicted, with how noisy each row's rounds were (``rounds``: how
    many, and the slowest step over the fastest, less one) and the cores' worth other
    processes took beside the fastest one (``other load``). Scale rows add, per step,
    measured -> predicted (ms): ``compute`` (CPU and waits for a core), the part of it spent
    ``waiting for a core``, and the rest (``comm+wait``: messages, their CPU and waiting for
    peers; the predicted rest includes the 2-worker step's ``offset_s``, carried over), to
    show which part of the step a miss comes from."""
    lines = ["| strategy | kind | measured ms | rounds, spread | other load | predicted ms | error "
             "| compute ms | waiting for a core ms | comm+wait ms |",
             "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        err = "-" if r["error"] is None else f"{r['error']:+.1%}"
        noise = str(len(r.get("steps_s") or []))
        if r.get("spread") is not None:
            noise += f", {r['spread']:.0%}"
        load = _fmt(r.get("other_load"), 1.0, 2)
        got, guess = r.get("measured_split"), r.get("predicted_split")
        parts = ["", "", ""]
        if got and guess:
            rest = [got["communication_and_waiting"],
                    guess["communication"] + guess["waiting"] + r.get("offset_s", 0.0)]  # fmt: skip
            core = (_fmt(got["compute"] - got["cpu"], 1e3) if "cpu" in got else "-",
                    _fmt(guess.get("core_compute"), 1e3))  # fmt: skip
            parts = [f"{got['compute'] * 1e3:.1f} -> {guess['compute'] * 1e3:.1f}",
                     f"{core[0]} -> {core[1]}",
                     f"{rest[0] * 1e3:.1f} -> {rest[1] * 1e3:.1f}"]  # fmt: skip
        head = f"| {r['strategy']} | {r['kind']} | {_fmt(r['measured_s'], 1e3)} | {noise} | "
        lines.append(head + f"{load} | {_fmt(r['predicted_s'], 1e3)} | {err} | "
                     + " | ".join(parts) + " |")  # fmt: skip
    return "\n".join(lines)


def _range(values: list, scale: float = 1.0, digits: int = 1) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    lo, hi = min(values) * scale, max(values) * scale
    return f"{lo:.{digits}f}" if lo == hi else f"{lo:.{digits}f}-{hi:.{digits}f}"


def base_table(rows: list[dict]) -> str:
    """What each strategy's scale rows started from (:mod:`.base`): its 2-worker rounds'
    measured steps, main-thread CPU per step (the compute the prediction used: the least)
    and the other load beside them, and the link fitted to its fastest transfers."""
    lines = ["| strategy | base rounds | step ms | spread | CPU ms per step (least used) "
             "| other load | link alpha us, GB/s |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    seen = set()
    for r in rows:
        base = r.get("base")
        if not base or r["strategy"] in seen:
            continue
        seen.add(r["strategy"])
        link = r.get("link") or {}
        beta = link.get("beta_s_per_byte") or 0.0
        speed = f"{link.get('alpha_s', 0.0) * 1e6:.0f}, " + (
            f"{1e-9 / beta:.2f}" if beta else "inf"
        )
        lines.append(f"| {r['strategy']} | {base['rounds']} | {_range(base['steps_s'], 1e3)} | "
                     f"{_fmt(base.get('spread'), 100, 0)}% | {_range(base['cpu_s'], 1e3)} | "
                     f"{_range(base['other_load'], 1.0, 2)} | {speed} |")  # fmt: skip
    return "\n".join(lines)


def split_table(result: Result) -> str:
    lines = ["| rank | step ms | compute | communication | waiting |", "|---|---|---|---|---|"]
    for r in sorted(result.end):
        s = result.per_step_split(r)
        lines.append(f"| {r} | {result.step_s(r) * 1e3:.2f} | {s['compute'] * 1e3:.2f} | "
                     f"{s['communication'] * 1e3:.2f} | {s['waiting'] * 1e3:.2f} |")  # fmt: skip
    return "\n".join(lines)
