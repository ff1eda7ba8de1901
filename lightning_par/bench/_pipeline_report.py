"""The pipeline benchmark's rows, goals and tables, from what every device measured
(:mod:`._pipeline_timing`): a row per contender with its step time, speed-ups, bubbles (the
formula's, the schedule replayed with the measured step costs, the measured one) and the
per-stage CPU, memory and message figures."""

from __future__ import annotations

from lightning_par.bench._pipeline_contenders import PEERS, layout_of, schedule_of, virtual_of
from lightning_par.pipeline.schedules import Schedule
from lightning_par.pipeline.timeline import mean_costs, measured_bubble, replayed_bubble


def imbalance_floor(device_cpu: list[float]) -> float:
    """The bubble that unequal devices leave even under a perfect schedule: while the
    busiest device works, the others finish their share and wait,
    ``1 - mean / max`` of the devices' CPU per step (``imbalance_floor``)."""
    return 1.0 - sum(device_cpu) / (len(device_cpu) * max(device_cpu))


def _with_measured_costs(traces: list, steps: range, kind: Schedule, k: int, m: int,
                         v: int) -> dict:  # fmt: skip
    """The row's schedule replayed with the costs its steps measured (free messages):
    ``theory_bubble_measured_costs``, beside the formula's ``theory_bubble`` (which assumes
    the textbook costs), and the mean span per op, ``mean_step_ms``."""
    schedule = kind.steps(k, m, v)
    replayed = [replayed_bubble(traces, n, schedule, k * v) for n in steps]
    costs = [mean_costs(traces, n) for n in steps]
    return {
        "theory_bubble_measured_costs": sum(replayed) / len(replayed),
        "mean_step_ms": {op: 1e3 * sum(c[op] for c in costs) / len(costs) for op in costs[0]},
    }


def _traced(row: dict, ranks: list[dict], i: int, stages: int, steps: int) -> None:
    """Our row ``i``'s figures from the traces: memory, messages, measured and replayed
    bubbles, and the gap to the formula."""
    run0 = ranks[0]["runs"][i]
    for key in ("peak_saved_bytes", "messages_per_step", "bytes_per_step"):
        row[key] = [r["runs"][i][key] for r in ranks]
    traces = [r["runs"][i]["trace"] for r in ranks]
    first = run0["first_step"]
    bubbles = [measured_bubble(traces, first + n) for n in range(steps)]
    row["measured_bubble"] = sum(bubbles) / len(bubbles)
    row.update(_with_measured_costs(traces, range(first, first + steps), schedule_of(run0["name"]),
                                    stages, run0["chunks"], row["virtual_stages"]))  # fmt: skip
    # the distance to the formula, in two parts: what the schedule loses with the measured
    # step costs (unequal stages, B/W not equal thirds), and what the run lost on top of that
    # replay (messages, the loop, other processes)
    row["bubble_gap_costs"] = row["theory_bubble_measured_costs"] - row["theory_bubble"]
    row["bubble_gap_runtime"] = row["measured_bubble"] - row["theory_bubble_measured_costs"]


def rows(ranks: list[dict], stages: int, steps: int, virtual: int,
         failed: dict[str, str] | None = None) -> list[dict]:  # fmt: skip
    """One row per contender from every device's measurements (``ranks``), then one per peer
    that ``failed`` (name -> its failure: ``{"name", "failed"}``)."""
    naive = ranks[0]["runs"][0]["step_s"]
    out = []
    for i, run0 in enumerate(ranks[0]["runs"]):
        name, m = run0["name"], run0["chunks"]
        step_s = max(r["runs"][i]["step_s"] for r in ranks)
        cpu = [r["runs"][i]["cpu_s"] for r in ranks]
        row = {"name": name, "chunks": m, "step_ms": step_s * 1e3,
               "speedup_vs_naive": naive / step_s, "stage_cpu_ms": [c * 1e3 for c in cpu],
               "imbalance_floor": imbalance_floor(cpu),
               "virtual_stages": virtual_of(name, virtual),
               "balance": ranks[0]["balances"][layout_of(name)][m],
               "theory_bubble": schedule_of(name).bubble(stages, m,
                                                         virtual_of(name, virtual))}  # fmt: skip
        if "trace" in run0:
            _traced(row, ranks, i, stages, steps)
        out.append(row)
    best_torch = min((r["step_ms"] for r in out if r["name"].startswith("torch")), default=None)
    by_name = {(r["name"], r["chunks"]): r["step_ms"] for r in out}
    for row in out:
        if best_torch is not None:
            row["speedup_vs_torch_best"] = best_torch / row["step_ms"]
        peer = by_name.get((PEERS.get(row["name"]), row["chunks"]))
        if peer is not None:  # torch's same schedule at the same chunks over ours
            row["speedup_vs_torch_peer"] = peer / row["step_ms"]
    return out + [{"name": name, "failed": error} for name, error in (failed or {}).items()]


def goals(rows: list[dict]) -> dict:
    """The issue's speed goals from one run: our fastest row against torch's fastest
    ``ScheduleGPipe`` row and torch's fastest row, and how far CPU time lets any schedule of
    ours go: ``cpu_bound_ms``, the busiest device's CPU per step (a step cannot be shorter
    even with no bubble and free messages) of our row whose busiest device is cheapest."""
    measured = [r for r in rows if "failed" not in r]
    ours = [r for r in measured if not r["name"].startswith("torch") and r["name"] != "naive"]
    theirs = [r for r in measured if r["name"].startswith("torch")]
    best = min(ours, key=lambda r: r["step_ms"])
    bound = min(ours, key=lambda r: max(r["stage_cpu_ms"]))
    out = {
        "ours_best": [best["name"], best["chunks"], best["step_ms"]],
        "cpu_bound_ms": [bound["name"], bound["chunks"], max(bound["stage_cpu_ms"])],
    }
    gpipes = [r for r in theirs if r["name"] == "torch ScheduleGPipe"]
    if gpipes:  # (absent when torch's ScheduleGPipe failed or was not asked for)
        gpipe = min(gpipes, key=lambda r: r["step_ms"])
        out["torch_gpipe_best"] = [gpipe["chunks"], gpipe["step_ms"]]
        out["best_vs_torch_gpipe"] = gpipe["step_ms"] / best["step_ms"]
        out["cpu_bound_vs_torch_gpipe"] = gpipe["step_ms"] / max(bound["stage_cpu_ms"])
    if theirs:
        top = min(theirs, key=lambda r: r["step_ms"])
        out["torch_best"] = [top["name"], top["chunks"], top["step_ms"]]
        out["best_vs_torch_best"] = top["step_ms"] / best["step_ms"]
    return out


def _heading(result: dict) -> list[str]:
    cuts = "; ".join(f"{k} " + ", ".join(f"M={m}: {c}" for m, c in v.items())
                     for k, v in result.get("balances", {}).items())  # fmt: skip
    kept = "; freed memory kept" if result.get("keep_freed_memory") else ""
    lines = [f"## {result['workload']} (balance {result['balance']}; cuts: {cuts}{kept})", ""]
    single = ", ".join(
        f"{k.replace('_', ' ')} {v:.1f} ms" for k, v in result["single_process_ms"].items()
    )
    lines += [f"one process: {single}", ""]
    g = result["goals"]
    best, bound = g["ours_best"], g["cpu_bound_ms"]
    ours = f"our best: {best[0]} M={best[1]} {best[2]:.1f} ms"
    if "torch_gpipe_best" in g:
        gpipe = g["torch_gpipe_best"]
        ours += (f"; {g['best_vs_torch_gpipe']:.2f}x torch's best ScheduleGPipe (M={gpipe[0]}, "
                 f"{gpipe[1]:.1f} ms; goal >= 1.15x)")  # fmt: skip
    if "torch_best" in g:
        top = g["torch_best"]
        ours += f"; {g['best_vs_torch_best']:.2f}x torch's best ({top[0]} M={top[1]}; goal >= 1.0x)"
    bound_line = f"CPU bound: {bound[0]} M={bound[1]}'s busiest device, {bound[2]:.0f} ms per step"
    if "cpu_bound_vs_torch_gpipe" in g:
        bound_line += (f", {g['cpu_bound_vs_torch_gpipe']:.2f}x torch's best ScheduleGPipe step "
                       "(a step is never shorter than its busiest device's CPU time: quiet, "
                       "this caps our speed-up)")  # fmt: skip
    return lines + [ours, "", bound_line, ""]


def _table_row(r: dict) -> str:
    if "failed" in r:
        return f"| {r['name']} | failed: {r['failed']} |" + " |" * 12
    measured = f"{r['measured_bubble']:.0%}" if "measured_bubble" in r else "-"
    peer = f"{r['speedup_vs_torch_peer']:.2f}x" if "speedup_vs_torch_peer" in r else "-"
    replayed = r.get("theory_bubble_measured_costs")
    replayed = "-" if replayed is None else f"{replayed:.0%}"
    vs_best = f"{r['speedup_vs_torch_best']:.2f}x" if "speedup_vs_torch_best" in r else "-"
    gaps = (f"{r['bubble_gap_costs']:+.3f} / {r['bubble_gap_runtime']:+.3f}"
            if "bubble_gap_costs" in r else "-")  # fmt: skip
    return (
        f"| {r['name']} | {r['chunks']} | {r['step_ms']:.1f} | {r['speedup_vs_naive']:.2f}x "
        f"| {peer} | {vs_best} | {measured} "
        f"| {r['theory_bubble']:.0%} | {replayed} | {gaps} | {r['imbalance_floor']:.3f} "
        f"| {'/'.join(f'{c:.0f}' for c in r['stage_cpu_ms'])} "
        f"| {'/'.join(f'{b / 2**20:.1f}' for b in r.get('peak_saved_bytes', [])) or '-'} "
        f"| {'/'.join(f'{n:g}' for n in r.get('messages_per_step', [])) or '-'} |"
    )


def report(result: dict) -> str:
    """One workload's result as Markdown: the goals, a table of the rows, the saved bytes."""
    lines = _heading(result)
    lines.append(
        "| run | M | step (ms) | vs naive | vs torch peer | vs best torch | bubble measured "
        "| theory | theory (measured costs) | gap: costs / runtime | imbalance floor "
        "| CPU/stage (ms) "
        "| peak saved/stage (MiB) | messages/stage |"
    )
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    lines += [_table_row(r) for r in result["rows"]]
    lines += [
        "",
        f"saved activations per stage at M={result['saved_at_chunks']} (GPipe schedule):",
        "",
    ]
    k = len(next(iter(result["saved_activation_bytes_per_stage"].values())))
    lines += ["| checkpoint | " + " | ".join(f"stage {s}" for s in range(k)) + " |",
              "|---" * (k + 1) + "|"]  # fmt: skip
    for mode, per_stage in result["saved_activation_bytes_per_stage"].items():
        lines.append(f"| {mode} | " + " | ".join(f"{b / 2**20:.1f} MiB" for b in per_stage) + " |")
    return "\n".join(lines)
