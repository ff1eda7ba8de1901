"""The compare's report: one Markdown page with its PNG figures, and the machine it ran on."""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path
from typing import Any

COLUMNS = [
    ("strategy", "the registered name (`Trainer(strategy=...)`), with the options the run "
                 "added (`zero:stage=1`)."),
    ("procs", "processes it ran: workers (devices), plus parameter servers where it has them."),
    ("images/s", "global batch divided by step time: training throughput of the whole job."),
    ("step ms", "wall time of one step (its start to the next step's start), mean over ranks."),
    ("vs DDP", "step time over torch DDP's (`lightning_ddp`), fastest round of each: below 1 "
               "is faster than the reference (each round's ratio is in the JSON)."),
    ("compute", "part of the step a rank was computing (forward, backward, optimiser, loading "
                "the batch), with communication running behind it counted here."),
    ("comm", "part of the step a rank was blocked while its messages moved (or in a "
             "collective's own work such as the reduction)."),
    ("wait", "part of the step a rank was blocked on a peer that had not posted the other "
             "end of the message yet: stragglers, pipeline bubbles."),
    ("hidden", "time a background thread was blocked on messages while the rank computed: "
               "communication overlapped with backward, so not part of the step."),
    ("sent/step", "bytes the busiest rank sent per step, counted in the trace."),
    ("model", "the same, predicted by the plugin's cost model (see the notes below)."),
    ("state", "bytes of parameters, gradients and optimiser state on the fullest rank at the "
              "end of training: the storage they hold, each once (a sharded optimizer's "
              "pieces, a freed stage-3 layer: what is really there)."),
    ("peak mem", "peak resident memory of the fullest rank (CPU: max RSS, interpreter and "
                 "torch included; CUDA: torch.cuda.max_memory_allocated)."),
    ("loss", "training loss of the last step, averaged over ranks (= over the global batch)."),
]  # fmt: skip


def machine_info(accelerator: str) -> dict[str, Any]:
    """CPU, cores, GPU, load and software versions."""
    import lightning
    import torch

    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = None
    if accelerator == "cuda" and torch.cuda.is_available():
        gpu = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    return {
        "cpu": cpu or "unknown",
        "cores": os.cpu_count(),
        "gpu": gpu,
        "load_1m_start": round(os.getloadavg()[0], 2),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "platform": platform.platform(),
    }


def _mb(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**20:.2f} MB" if n >= 2**20 else f"{n / 1024:.1f} kB"


def _ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1e3:.1f}"


def table(rows: list[dict]) -> str:
    head = "| " + " | ".join(name for name, _ in COLUMNS) + " |"
    lines = [head, "|" + "---|" * len(COLUMNS)]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['strategy']} | {r['processes']} | failed: {r['error']} |"
                         + " |" * (len(COLUMNS) - 3))  # fmt: skip
            continue
        model = r["model_bytes_per_step"]
        ratio = f" ({r['bytes_ratio']:.3f}x)" if r.get("bytes_ratio") else ""
        peak = r["peak_device_bytes_max"] or r["peak_rss_bytes_max"]
        vs = "-" if r.get("vs_ddp") is None else f"{r['vs_ddp']:.2f}"
        if r["traced"]:
            split = [
                _ms(r[k]) for k in ("compute_s", "communication_s", "waiting_s", "overlapped_s")
            ]
            sent = f"{_mb(r['bytes_sent_per_step'])}{ratio}"
        else:
            split, sent = ["untraced"] * 4, "untraced"
        cells = [r["strategy"], r["processes"], f"{r['images_per_s']:.0f}", _ms(r["step_s"]), vs,
                 *split, sent, _mb(model) if model is not None else "no model",
                 _mb(r["state_bytes_max"]), _mb(peak), f"{r['final_loss']:.4f}"]  # fmt: skip
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def figures(rows: list[dict], out: Path) -> list[str]:
    """PNG figures of the ok rows; returns their file names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r["status"] == "ok"]
    if not ok:
        return []
    names = [r["strategy"] for r in ok]
    y = range(len(ok))
    files = []

    fig, ax = plt.subplots(figsize=(8, 0.45 * len(ok) + 1.5))
    left = [0.0] * len(ok)
    for key, label, colour in (("compute_s", "compute", "tab:blue"),
                               ("communication_s", "communication", "tab:orange"),
                               ("waiting_s", "waiting", "tab:red")):  # fmt: skip
        ms = [r[key] * 1e3 if r["traced"] else 0.0 for r in ok]
        ax.barh(y, ms, left=left, label=label, color=colour)
        left = [a + b for a, b in zip(left, ms)]
    untraced = [r["step_s"] * 1e3 if not r["traced"] else 0.0 for r in ok]
    if any(untraced):
        ax.barh(y, untraced, label="not traced", color="lightgrey")
    ax.set(yticks=list(y), yticklabels=names, xlabel="ms per step", title="Where a step goes")
    ax.invert_yaxis()
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=4)
    files.append(_save(fig, out / "step_split.png"))

    fig, axes = plt.subplots(1, 3, figsize=(13, 0.45 * len(ok) + 1.5), sharey=True)
    axes[0].barh(y, [r["images_per_s"] for r in ok], color="tab:green")
    axes[0].set(yticks=list(y), yticklabels=names, xlabel="images/s", title="Throughput")
    sent = [(r["bytes_sent_per_step"] or 0) / 2**20 for r in ok]
    model = [(r["model_bytes_per_step"] or 0) / 2**20 for r in ok]
    axes[1].barh([i - 0.2 for i in y], sent, height=0.4, label="measured")
    axes[1].barh([i + 0.2 for i in y], model, height=0.4, label="cost model")
    axes[1].set(xlabel="MB sent per step (busiest rank)", title="Bytes")
    axes[1].legend(loc="lower right")
    axes[2].barh(y, [r["state_bytes_max"] / 2**20 for r in ok], color="tab:purple")
    axes[2].set(xlabel="MB of params + grads + optimiser state", title="Memory (fullest rank)")
    axes[0].invert_yaxis()
    files.append(_save(fig, out / "throughput_bytes_memory.png"))

    fig, ax = plt.subplots(figsize=(8, 4))
    colours = plt.get_cmap("tab20").colors
    for i, r in enumerate(ok):
        ax.plot(r["loss_curve"], label=r["strategy"], lw=1, color=colours[i % len(colours)])
    ax.set(xlabel="step", ylabel="training loss",
           title="Loss per step (mean over ranks; synchronous strategies overlap)")  # fmt: skip
    ax.legend(fontsize=7, ncol=2)
    files.append(_save(fig, out / "loss.png"))
    return files


def _save(fig, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path.name


def markdown(doc: dict, pictures: list[str], predicted: list[str] | None = None) -> str:
    """The report page; ``predicted``: the simulator's section (see :mod:`.predicted`)."""
    m, s = doc["machine"], doc["settings"]
    gpu = f", GPU {m['gpu']}" if m["gpu"] else ""
    lines = [
        f"# Every plugin on one model: {s.get('model_spec', s['model'])}, {s['steps']} steps",
        "",
        "Each registered strategy trains the same model from the same weights on the same "
        "samples; the table says how fast, where each step's time goes, how many bytes "
        "each process sends (measured and predicted) and how much each device holds. "
        "Regenerate it with the command below (`--json` for the numbers).",
        "",
        f"Command: `{doc['command']}`",
        "",
        f"Ran on {m['cpu']} ({m['cores']} cores{gpu}), {s['accelerator']}; Python "
        f"{m['python']}, torch {m['torch']}, Lightning {m['lightning']}; load average "
        f"{m['load_1m_start']} before, {m.get('load_1m_end', '-')} after (uptime). Data: "
        f"{s['data']}; global batch {s['global_batch']} per step for every strategy; times "
        f"are means over steps {s['warmup']}..{s['steps'] - 1} (the first {s['warmup']} "
        "warm up). Times in milliseconds per step. Times on a shared machine are noisy: "
        "compare columns, not digits.",
        "",
        *_load_warning(m, s.get("devices") or 0),
        table(doc["rows"]),
        "",
        "## What this run says",
        "",
        *takeaways(doc["rows"]),
        "",
        "## The columns",
        "",
        *[f"- **{name}**: {text}" for name, text in COLUMNS],
        "",
        "compute + comm + wait = step ms. The split comes from the traces every plugin "
        "records (`trace_dir=`): see `lightning_par/measure/breakdown.py` for the rules.",
        "",
        "## Cost models",
        "",
        *[f"- **{r['strategy']}**: {r['model_note']}" for r in doc["rows"] if "model_note" in r],
        "",
        "## Reading it",
        "",
        *notes(doc["rows"]),
        "",
    ]
    lines += [f"![{p}]({p})\n" for p in pictures]
    lines += predicted or []
    return "\n".join(lines)


def notes(rows: list[dict]) -> list[str]:
    """Caveats that apply to the rows of this report."""
    out = [
        "- Every strategy reads the same samples at each step (file order, no shuffling; a "
        "data-parallel rank r of R reads samples r, r+R, ...), so the synchronous strategies "
        "compute the same updates as one process and their losses agree to float rounding. "
        "`async_sgd` (stale gradients) and `local_sgd` (averaging every few steps) differ "
        "by design.",
        "- The busiest rank is the one that sends the most; for pipelines it is the last "
        "stage, which also sends the output to every other stage.",
    ]
    if any(r.get("servers") for r in rows):
        out.append(
            "- Parameter servers run in processes of their own without a trace: a worker "
            "blocked on a pull counts as communication, whatever its server was doing, and "
            "the servers' memory (parameters and optimiser state) is not in *state*."
        )
    if any(r["status"] == "ok" and not r["traced"] for r in rows):
        out.append(
            "- *untraced*: torch's DDP allreduces inside its C++ reducer, which lightning_par's "
            "communicator does not see; its step time is measured, its split is not."
        )
    failed = [r for r in rows if r["status"] != "ok"]
    out += [f"- **{r['strategy']} failed**: {r['error']}" for r in failed]
    return out


def takeaways(rows: list[dict]) -> list[str]:
    """A few sentences read off the rows: fastest, most bytes, least memory, most waiting."""
    ok = [r for r in rows if r["status"] == "ok"]
    if not ok:
        return ["- Nothing ran."]
    fast = sorted(ok, key=lambda r: r["step_s"])
    out = [f"- Fastest: **{fast[0]['strategy']}** ({fast[0]['images_per_s']:.0f} images/s); "
           f"slowest: **{fast[-1]['strategy']}** ({fast[-1]['images_per_s']:.0f})."]  # fmt: skip
    sent = [r for r in ok if r.get("bytes_sent_per_step")]
    if sent:
        most = max(sent, key=lambda r: r["bytes_sent_per_step"])
        least = min(sent, key=lambda r: r["bytes_sent_per_step"])
        out.append(
            f"- Most bytes per step: **{most['strategy']}** ({_mb(most['bytes_sent_per_step'])}); "
            f"fewest: **{least['strategy']}** ({_mb(least['bytes_sent_per_step'])}). Data "
            "parallelism moves gradients (the model's size), pipelines move activations "
            "(batch x features at each cut), so which is cheaper depends on the model and batch."
        )
    small = min(ok, key=lambda r: r["state_bytes_max"])
    big = max(ok, key=lambda r: r["state_bytes_max"])
    out.append(
        f"- Least model state on one device: **{small['strategy']}** "
        f"({_mb(small['state_bytes_max'])}, against {_mb(big['state_bytes_max'])} for "
        f"{big['strategy']}): a split model or servers holding the optimiser state."
    )
    traced = [r for r in ok if r["traced"]]
    if traced:
        idle = max(traced, key=lambda r: r["waiting_s"] / r["step_s"])
        out.append(
            f"- Most time waiting for a peer: **{idle['strategy']}** "
            f"({100 * idle['waiting_s'] / idle['step_s']:.0f} % of its step)."
        )
    checked = [r for r in ok if r.get("bytes_ratio")]
    exact = [r["strategy"] for r in checked if abs(r["bytes_ratio"] - 1) < 1e-9]
    if checked:
        out.append(f"- Bytes equal to the cost model exactly: {len(exact)} of {len(checked)} "
                   "modelled strategies (the others: see the notes on what the model leaves "
                   "out).")  # fmt: skip
    return out


def _load_warning(machine: dict, own: int) -> list[str]:
    """Warn when other jobs shared the cores: the load before the run, or the load after it
    less the ``own`` worker processes the comparison itself kept busy in its last minute."""
    before, after = machine["load_1m_start"], machine.get("load_1m_end") or 0
    cores = machine["cores"]
    if not cores or (before <= cores and after - own <= cores):
        return []
    load = max(before, after)
    return [
        f"**The machine was oversubscribed (load {load} on {machine['cores']} cores, other "
        "jobs running): the time columns mostly say which run got the CPU. Bytes, state, "
        "and losses are exact whatever the load.**",
        "",
    ]
