"""Every everyday Lightning feature under every strategy: the one table of expected outcomes.

``tests/test_features.py`` runs every cell (2 processes, a tiny model, a few steps) and
checks it against this table; the README's table is :func:`markdown_table` (a test keeps
them equal: ``python -m lightning_par.features`` prints it). A strategy's row is one entry
of :data:`ROWS`: a default outcome and the features that differ from it. The allreduce
strategies (one per collective) share the row ``*_allreduce``.

Outcomes:

* ``exact``: the same weights (float tolerance) as one process on the whole batch;
* ``as DDP``: the same weights as Lightning's DDP (``lightning_ddp``), where one process is
  a different computation (BatchNorm statistics per replica);
* ``runs``: trains (finite weights that moved); exactness does not apply (asynchronous
  updates, local SGD's periodic averaging, the reference itself);
* ``warns``: runs, with a warning before launch that says how it differs;
* ``differs``: runs and ends with different weights, documented (the reference only);
* ``refused``: stopped before any process starts, with a message naming the strategy and
  the feature (the text shown is part of it);
* ``error``: stopped at the first step that meets it, with that message.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Outcome:
    kind: str  # one of KINDS
    message: str = ""  # refused/error/warns: a fragment of the message; differs: why
    #: error: another message a run may show first (a peer's report of the failure)
    also: str = ""

    def __str__(self) -> str:
        text = f"{self.kind}: {self.message}" if self.message else self.kind
        return f"{text} (or, from a peer first: {self.also})" if self.also else text

    def matches(self, message: str) -> bool:
        return self.message in message or bool(self.also and self.also in message)


KINDS = ("exact", "as DDP", "runs", "warns", "differs", "refused", "error")
EXACT, AS_DDP, RUNS = Outcome("exact"), Outcome("as DDP"), Outcome("runs")


def refused(message: str) -> Outcome:
    return Outcome("refused", message)


#: Feature name -> what the test switches on (2 processes, 4 optimiser steps).
FEATURES: dict[str, str] = {
    "accumulate_grad_batches": "Trainer(accumulate_grad_batches=2)",
    "clip_norm": "gradient_clip_val=0.05 (norm)",
    "clip_value": "gradient_clip_val=0.01, gradient_clip_algorithm='value'",
    "step_scheduler": "OneCycleLR stepped every optimiser step",
    "adamw": "AdamW",
    "unused_parameters": "a layer forward never uses",
    "module_parameter": "an nn.Parameter owned by the LightningModule (output scale)",
    "manual_optimization": "automatic_optimization=False, manual_backward, opt.step()",
    "resume_mid_epoch": "2 steps, checkpoint, resume to 4 (epoch of 4 batches)",
    "batchnorm": "a BatchNorm1d layer",
    "bf16_mixed": "precision='bf16-mixed'",
    "fp16_mixed_scaler": "16-mixed with a GradScaler (CPU: MixedPrecision('16-mixed', 'cpu'))",
    "sync_batchnorm": "sync_batchnorm=True with a BatchNorm1d layer",
    "evaluate_after_fit": "validate, test and predict after fit",
    "early_stopping": "EarlyStopping on the training loss",
    "fit_twice": "fit 2 steps, then fit 2 more with a new Trainer",
    "unfreeze": "a layer frozen at setup, unfrozen at step 2 (the optimiser holds it)",
    "add_param_group": "a frozen head unfrozen and added as a new param group at step 2 "
    "(BackboneFinetuning's pattern)",
    "frozen_layer": "a layer frozen throughout (requires_grad=False, in the optimiser)",
    "tied_weights": "a layer applied twice (one nn.Linear at two places of the nn.Sequential)",
    "lbfgs": "LBFGS (its line search calls the closure up to 3 times a step)",
}


#: A rank of a split model steps on its part only: LBFGS reads the whole model
#: (lightning_par.components.split_optimizers), stopped at setup
def _no_lbfgs(strategy: str) -> Outcome:
    return Outcome("error", f"{strategy} cannot run LBFGS")


#: torch's SyncBatchNorm runs on GPUs only
_SYNC_BN_CPU = Outcome("error", "SyncBatchNorm expected input tensor to be on GPU")

_PS_REFUSALS = {
    "manual_optimization": refused("supports automatic optimisation only"),
    "fp16_mixed_scaler": refused("refuses precision='16-mixed' (MixedPrecision with a GradScaler)"),
    "sync_batchnorm": refused("refuses sync_batchnorm=True"),
    "unfreeze": Outcome("error", "that are frozen (requires_grad=False) when fit starts"),
    "add_param_group": Outcome("error", "became trainable after setup"),
    "frozen_layer": Outcome("error", "that are frozen (requires_grad=False) when fit starts"),
}
#: async_sgd's workers are not in step: when one stops, another may report the lost
#: servers before the launcher shows the first worker's message
_ASYNC_ERRORS = {
    "add_param_group": Outcome(
        "error", "became trainable after setup", also="Connection reset by peer"
    ),
}


@dataclass(frozen=True)
class Row:
    """One strategy's outcomes: ``default`` for every feature not in ``cells``, on
    ``devices`` processes of which ``replicas`` read different samples (``None``: all)."""

    default: Outcome
    cells: dict[str, Outcome] = field(default_factory=dict)
    devices: int = 2
    replicas: int | None = None

    @property
    def data_world(self) -> int:
        """How many shards each global batch is cut into."""
        return self.replicas or self.devices

    def outcome(self, feature: str) -> Outcome:
        if feature not in FEATURES:
            raise KeyError(f"no feature {feature!r}; choose one of {list(FEATURES)}")
        return self.cells.get(feature, self.default)


#: Strategy name (``*_allreduce``: every allreduce strategy) -> its row.
ROWS: dict[str, Row] = {
    "*_allreduce": Row(EXACT, {"batchnorm": AS_DDP, "sync_batchnorm": _SYNC_BN_CPU}),
    "gpipe": Row(EXACT, {
        "batchnorm": Outcome("warns", "each micro-batch is normalised with its own statistics"),
        "sync_batchnorm": refused("gpipe refuses sync_batchnorm=True"),
        "lbfgs": _no_lbfgs("gpipe"),
    }),
    "layerwise": Row(EXACT, {
        "sync_batchnorm": refused("layerwise refuses sync_batchnorm=True"),
        "lbfgs": _no_lbfgs("layerwise"),
    }),
    "parameter_server": Row(EXACT, {
        **_PS_REFUSALS, "batchnorm": AS_DDP, "lbfgs": _no_lbfgs("parameter_server"),
    }),
    "async_sgd": Row(RUNS, {**_PS_REFUSALS, **_ASYNC_ERRORS, "lbfgs": _no_lbfgs("async_sgd")}),
    "local_sgd": Row(RUNS, {"sync_batchnorm": _SYNC_BN_CPU}),
    # stage 3 (the registered default); stage 1 trains "unfreeze" exactly too
    "zero": Row(EXACT, {
        "batchnorm": AS_DDP, "sync_batchnorm": _SYNC_BN_CPU,
        "unfreeze": Outcome("error", "became trainable after setup"),
        "add_param_group": Outcome("error", "added to the optimizer after setup"),
        "lbfgs": Outcome("error", "zero steps each rank's slice of every parameter, so it "
                         "needs an optimizer whose update is element-wise; LBFGS is not"),
    }),
    "tensor_parallel": Row(EXACT, {
        "fp16_mixed_scaler": refused("tensor_parallel: a gradient scaler"),
        "sync_batchnorm": refused("tensor_parallel: sync_batchnorm"),
        # the layer stays whole (a cut would untie its two uses): nothing else pairs here
        "tied_weights": refused("net.2: its weights are used at another place too (tied, or "
                                "the same layer applied twice)"),
        "lbfgs": _no_lbfgs("tensor_parallel"),
    }),
    # 2 replicas × 2 gpipe stages; a replica's 4 samples make micro-batches of 1
    "hybrid": Row(EXACT, {
        "batchnorm": Outcome("error", "Expected more than 1 value per channel when training"),
        "sync_batchnorm": refused("hybrid refuses sync_batchnorm=True"),
        "lbfgs": _no_lbfgs("hybrid"),
    }, devices=4, replicas=2),
    "lightning_ddp": Row(EXACT, {
        "batchnorm": RUNS,
        "sync_batchnorm": Outcome("error", "SyncBatchNorm layers only work with GPU modules"),
        "unused_parameters": Outcome("error", "find_unused_parameters"),
        "unfreeze": Outcome("differs", "torch DDP's reducer fixes its parameters at setup"),
        "add_param_group": Outcome("differs", "torch DDP's reducer fixes its parameters at setup"),
    }),
}  # fmt: skip


#: One strategy per kind for the resume-across-strategies test: a checkpoint written under
#: any of them resumes under any other, under ``lightning_ddp`` and in one process.
RESUME_KINDS: dict[str, str] = {
    "allreduce": "ring_allreduce",
    "parameter server": "parameter_server",
    "async": "async_sgd",
    "local SGD": "local_sgd",
    "sharded": "zero",
    "pipeline": "gpipe",
    "layer-wise": "layerwise",
    "tensor": "tensor_parallel",
    "hybrid": "hybrid",
}
#: Their results are not one process's: a resume through them only has to train.
NOT_ONE_PROCESS = ("async_sgd", "local_sgd")


def resume_outcome(source: str, target: str) -> Outcome:
    """2 steps under ``source``, resumed to 4 under ``target``: ``exact`` (one process's
    weights) unless either side is not synchronous SGD, then ``runs``."""
    return RUNS if source in NOT_ONE_PROCESS or target in NOT_ONE_PROCESS else EXACT


def row_key(strategy: str) -> str:
    return "*_allreduce" if strategy.endswith("_allreduce") else strategy


def expected(strategy: str, feature: str) -> Outcome:
    """The table's outcome for one cell (``KeyError`` for a strategy with no row)."""
    return row(strategy).outcome(feature)


def row(strategy: str) -> Row:
    """A strategy's row (``KeyError`` for a strategy with no row)."""
    key = row_key(strategy)
    if key not in ROWS:
        raise KeyError(f"strategy {strategy!r} has no row in lightning_par.features.ROWS")
    return ROWS[key]


def markdown_table() -> str:
    """The table as Markdown (the README shows it): a column per entry of :data:`ROWS`, a
    row per feature, then each cell's message."""
    lines = [
        "| feature | " + " | ".join(f"`{key}`" for key in ROWS) + " |",
        "|---|" + "---|" * len(ROWS),
    ]
    for feature in FEATURES:
        cells = [row.outcome(feature).kind for row in ROWS.values()]
        lines.append(f"| `{feature}` | " + " | ".join(cells) + " |")
    notes = [
        f"- `{key}`, `{feature}`: {o}"
        for feature in FEATURES
        for key, row in ROWS.items()
        if (o := row.outcome(feature)).message
    ]
    return "\n".join([*lines, "", *notes]) + "\n"


if __name__ == "__main__":
    print(markdown_table(), end="")
