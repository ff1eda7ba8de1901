"""lightning_par: Lightning strategies that teach and run the classic ways to parallelise training.

Importing the package registers every strategy name (``ring_allreduce``, ``gpipe``, ...)
with Lightning's ``StrategyRegistry`` so that ``Trainer(strategy="ring_allreduce")`` works,
and filters Lightning's known harmless messages (:mod:`lightning_par.quiet`;
``LIGHTNING_PAR_QUIET=0`` keeps them).
"""

__version__ = "0.1.0"

from lightning_par.output import install_warning_format as _install_warning_format
from lightning_par.quiet import quiet_from_environment as _quiet_from_environment
from lightning_par.strategies import register_strategies as _register_strategies

_quiet_from_environment()
_install_warning_format()  # our warnings without a source path (lightning_par.output)
_register_strategies()
