"""Layer-wise model parallelism (no Lightning): consecutive layers on different processes,
and the stacked-RNN wavefront that streams a sequence through them in time chunks.

* :mod:`.recurrent`: recurrent layers whose hidden state is carried across time chunks;
* :mod:`.wavefront`: the wavefront schedule (pure functions) and its runtime, built on the
  pipeline stage runtime of :mod:`lightning_par.pipeline`;
* :mod:`.memory`: parameter, gradient, optimiser-state and activation bytes per stage.

The Lightning adapter is :class:`lightning_par.strategies.layerwise.LayerwiseStrategy`.
"""

from lightning_par.modelparallel.recurrent import (
    CarriedState,
    RecurrentLayer,
    is_recurrent,
    stacked_rnn,
)
from lightning_par.modelparallel.wavefront import (
    WavefrontSequential,
    recurrent_parts,
    time_chunk_sizes,
    train_step,
    wavefront_balance,
    wavefront_grid,
    wavefront_steps,
    wavefront_utilisation,
)

__all__ = [
    "CarriedState",
    "RecurrentLayer",
    "WavefrontSequential",
    "is_recurrent",
    "recurrent_parts",
    "stacked_rnn",
    "time_chunk_sizes",
    "train_step",
    "wavefront_balance",
    "wavefront_grid",
    "wavefront_steps",
    "wavefront_utilisation",
]
