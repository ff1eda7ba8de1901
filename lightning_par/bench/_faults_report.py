"""The text table of ``bench faults`` (:mod:`.faults`): one line per run, then the ratios."""

from __future__ import annotations

from typing import Any

#: Each figure's key, column width and format, after the run's name.
CELLS = (
    ("detect_s", 8, ".2f"), ("regroup_s", 9, ".2f"), ("steps_lost", 11, "d"),
    ("before_steps_per_s", 16, ".2f"), ("after_steps_per_s", 8, ".2f"), ("lost_s", 11, ".2f"),
    ("weights_max_diff", 11, ".1e"),
)  # fmt: skip


def _cell(value: Any, width: int, fmt: str) -> str:
    return f"{value:>{width}{fmt}}" if value is not None else f"{'-':>{width}}"


def _equal(row: dict[str, Any]) -> str:
    """``yes``/``NO`` where the strategy claims the reference's weights, ``-`` elsewhere."""
    if "weights_equal" not in row:
        return f"{'-':>7}"
    return f"{'yes' if row['weights_equal'] else 'NO':>7}"


def report(result: dict[str, Any]) -> str:
    model = result["model"]
    lines = [
        f"{'rank 0' if result.get('lost_rank') == 'first' else 'the last rank'} (or the last "
        f"server) killed as step {result['fault_step']} begins, launched by "
        f"{result.get('launch', 'lightning')} (CIFAR CNN "
        f"of width {model['width']} with {model['num_blocks']} blocks, batch "
        f"{model['batch_size']} per rank, CPU); times in seconds; weights: rank 0's largest "
        "parameter difference from the run without the fault, and equal where claimed",
        f"{'strategy':<18}{'lost':<8}{'p':>3}  {'approach':<16}{'detect':>8}{'regroup':>9}"
        f"{'steps lost':>11}{'steps/s before':>16}{'after':>8}{'time lost':>11}"
        f"{'weights':>11}{'equal':>7}",
    ]
    for row in result["rows"]:
        head = f"{row['strategy']:<18}{row['lost']:<8}{row['world']:>3}  {row['approach']:<16}"
        if "failed" in row:
            lines.append(f"{head}failed: {row['failed']}")
            continue
        lines.append(head + "".join(_cell(row.get(k), w, f) for k, w, f in CELLS) + _equal(row))
    for row in result["rows"]:
        if row.get("joined_s") is not None:
            pace = row.get("whole_steps_per_s")
            lines.append(
                f"{row['strategy']} p={row['world']}: the lost rank's replacement joined "
                f"{row['joined_s']:.1f} s after the fault; "
                + (f"{pace:.2f} steps/s after it" if pace else "no step after it")
            )
    for ratio in result["ratios"]:
        lines.append(
            f"{ratio['strategy']} ({ratio['lost']} lost) p={ratio['world']}: restart loses "
            f"{'at least ' if ratio['at_least'] else ''}"
            f"{ratio['restart_over_fault_tolerant']:.1f}x the time fault_tolerant does"
        )
    return "\n".join(lines)
