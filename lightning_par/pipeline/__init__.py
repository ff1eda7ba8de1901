"""GPipe-style pipeline parallelism as plain modules (no Lightning).

* :mod:`.partition`: cut an ``nn.Sequential`` into stages (by hand, by parameters, by time);
* :mod:`.microbatch`: split a batch into micro-batches and join the outputs;
* :mod:`.schedule`: GPipe and 1F1B as explicit (stage, op, micro-batch) step lists;
* :mod:`.schedules`: every schedule as one object (steps, placement, B/W split, loss per
  micro-batch, rules), looked up by name once (:func:`get_schedule`);
* :mod:`.checkpoint`: re-materialisation modes and saved-activation counting;
* :mod:`.schedules_v`: interleaved 1F1B and zero bubble (B/W split) as per-device step lists;
* :mod:`.validate`: the rules every schedule keeps, checked before it runs;
* :mod:`.multistage`: the one stage runtime, :class:`DeviceStages`: the stages one device
  holds (tuples of tensors between them, :mod:`.messages`; receives posted ahead,
  :mod:`.receives`; the B/W split, :mod:`.weight_grads`), running any validated schedule
  through :class:`lightning_par.comm.Communicator`;
* :mod:`.step`: a full training step (:func:`forward_backward`: GPipe with any loss on the
  joined output; :func:`~.step.scheduled_step`: any schedule, the loss per micro-batch);
* :mod:`.network` (with :mod:`.network_io`, :mod:`.tied`): the user's network run as
  pipeline stages in place, which the strategies install.

The Lightning adapter is :class:`lightning_par.strategies.gpipe.GPipeStrategy`.
"""

from lightning_par.pipeline.checkpoint import CHECKPOINT_MODES, SavedActivations, recomputes
from lightning_par.pipeline.microbatch import gather, micro_batch_sizes, scatter
from lightning_par.pipeline.multistage import DeviceStages
from lightning_par.pipeline.partition import (
    balance_by_params,
    balance_by_time,
    check_balance,
    split_sequential,
    stage_bounds,
)
from lightning_par.pipeline.schedule import Step, bubble_fraction, format_table
from lightning_par.pipeline.schedules import (
    SCHEDULES,
    Schedule,
    clock_table,
    get_schedule,
    schedule_steps,
)
from lightning_par.pipeline.step import forward_backward, scheduled_step
from lightning_par.split import balance_by_cost

__all__ = [
    "CHECKPOINT_MODES",
    "SCHEDULES",
    "DeviceStages",
    "SavedActivations",
    "Schedule",
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
    "get_schedule",
    "micro_batch_sizes",
    "recomputes",
    "scatter",
    "scheduled_step",
    "schedule_steps",
    "split_sequential",
    "stage_bounds",
]
