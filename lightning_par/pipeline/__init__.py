"""GPipe-style pipeline parallelism as plain modules (no Lightning).

* :mod:`.partition`: cut an ``nn.Sequential`` into stages (by hand, by parameters, by time);
* :mod:`.microbatch`: split a batch into micro-batches and join the outputs;
* :mod:`.schedule`: GPipe and 1F1B as explicit (stage, op, micro-batch) step lists;
* :mod:`.checkpoint`: re-materialisation modes and saved-activation counting;
* :mod:`.runtime`: one stage in one process, exchanging tensors through
  :class:`lightning_par.comm.Communicator`;
* :mod:`.schedules_v`: interleaved 1F1B and zero bubble (B/W split) as per-device step lists;
* :mod:`.validate`: the rules every schedule keeps, checked before it runs;
* :mod:`.multistage`: one device holding several stages (tuples of tensors between them,
  :mod:`.messages`), running any validated schedule;
* :mod:`.step`: a full training step for a loss on the joined output (``scheduled_step``:
  under any schedule);
* :mod:`.sequential`, :mod:`.sequential_v`, :mod:`.options`: the networks the strategies
  put in the model's place, and the checks of their schedule options.

The Lightning adapter is :class:`lightning_par.strategies.gpipe.GPipeStrategy`.
"""

from lightning_par.pipeline.checkpoint import CHECKPOINT_MODES, SavedActivations, recomputes
from lightning_par.pipeline.microbatch import gather, micro_batch_sizes, scatter
from lightning_par.pipeline.partition import (
    balance_by_params,
    balance_by_time,
    check_balance,
    split_sequential,
    stage_bounds,
)
from lightning_par.pipeline.runtime import PipelineStage
from lightning_par.pipeline.schedule import (
    SCHEDULES,
    Step,
    bubble_fraction,
    clock_table,
    format_table,
    schedule_steps,
    stage_steps,
)
from lightning_par.pipeline.step import forward_backward
from lightning_par.split import balance_by_cost

__all__ = [
    "CHECKPOINT_MODES",
    "SCHEDULES",
    "PipelineStage",
    "SavedActivations",
    "Step",
    "balance_by_cost",
    "balance_by_params",
    "balance_by_time",
    "bubble_fraction",
    "check_balance",
    "clock_table",
    "forward_backward",
    "format_table",
    "gather",
    "micro_batch_sizes",
    "recomputes",
    "scatter",
    "schedule_steps",
    "split_sequential",
    "stage_bounds",
    "stage_steps",
]
