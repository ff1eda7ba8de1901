"""lightning_par: Lightning strategies that teach and run the classic ways to parallelise training.

Importing the package registers every strategy name (``ring_allreduce``, ``gpipe``, ...)
with Lightning's ``StrategyRegistry`` so that ``Trainer(strategy="ring_allreduce")`` works.
"""

__version__ = "0.1.0"

from lightning_par.strategies import register_strategies as _register_strategies

_register_strategies()
