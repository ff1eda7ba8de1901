"""The report's rows: one per strategy, from its runs (one per round) and its cost model.

Rounds run interleaved (every strategy once, then again), so load that comes and goes on a
shared machine hits all strategies alike. A strategy's row is its fastest round (the one
least disturbed); ``vs_ddp`` divides its step time by ``lightning_ddp``'s fastest, and
``vs_ddp_rounds`` lists the ratio within each round.
"""

from __future__ import annotations

from pathlib import Path

from lightning_par.compare.costs import predicted_bytes
from lightning_par.measure.analyse import analyse
from lightning_par.measure.run import make_model
from lightning_par.strategies.registry import spec

REFERENCE = "lightning_ddp"


def build_row(row: dict, result: dict, warmup: int) -> dict:
    """One run's row: what :func:`~lightning_par.measure.analyse.analyse` measured, the cost
    model's bytes beside the measured ones, or the error."""
    s = spec(row.get("name", row["strategy"]))
    options = {**s.options, **row.get("options", {})}
    out = {"strategy": row["strategy"], "name": s.name, "options": row.get("options", {}),
           "kind": s.kind, "model": row["model"],
           "accelerator": row["accelerator"], "workers": row["devices"],
           "servers": result.get("servers", 0), "global_batch": row["global_batch"],
           "round": row["round"], "run_s": result.get("seconds")}  # fmt: skip
    out["processes"] = out["workers"] + out["servers"]
    if "error" in result:
        return {**out, "status": "failed", "error": result["error"]}
    try:
        found = analyse(Path(row["folder"]), warmup, row["global_batch"])
    except (RuntimeError, OSError, ValueError) as err:
        return {**out, "status": "failed", "error": f"no measurements: {err}"}
    model, note = predicted_bytes(s.name, options, s.load(), make_model(row["model"]),
                                  row["devices"], row["global_batch"])  # fmt: skip
    sent = [b for b in found.pop("bytes_sent_per_rank") if b is not None]
    busiest = max(sent) if found["traced"] and sent else None
    modelled = max(model) if model else None
    return {
        **out, "status": "ok", "per_rank_batch": row["global_batch"] // result["data_replicas"],
        "start_method": result.get("start_method"), "data": result.get("data"), **found,
        "bytes_sent_per_step": busiest,
        "bytes_sent_per_step_per_rank": sent if found["traced"] else None,
        "model_bytes_per_step": modelled, "model_bytes_per_step_per_rank": model,
        "model_note": note,
        "bytes_ratio": busiest / modelled if busiest is not None and modelled else None,
        "state_bytes_max": max(found["state_bytes_per_rank"]),
        "peak_rss_bytes_max": max(found["peak_rss_bytes_per_rank"]),
        "peak_device_bytes_max": max(found["peak_device_bytes_per_rank"] or [0]) or None,
    }  # fmt: skip


def combine(runs: list[dict]) -> list[dict]:
    """One row per strategy (in first-seen order) from its rounds' rows."""
    by_name: dict[str, list[dict]] = {}
    for r in runs:
        by_name.setdefault(r["strategy"], []).append(r)
    reference = {r["round"]: r["step_s"] for r in by_name.get(REFERENCE, []) if r["status"] == "ok"}
    rows = []
    for rounds in by_name.values():
        ok = [r for r in rounds if r["status"] == "ok"]
        if not ok:
            rows.append({**rounds[0], "failed_rounds": len(rounds)})
            continue
        best = dict(min(ok, key=lambda r: r["step_s"]))
        best["round_step_s"] = [r["step_s"] for r in ok]
        best["failed_rounds"] = len(rounds) - len(ok)
        ratios = [r["step_s"] / reference[r["round"]] for r in ok if r["round"] in reference]
        best["vs_ddp_rounds"] = ratios
        best["vs_ddp"] = best["step_s"] / min(reference.values()) if reference else None
        rows.append(best)
    return rows
