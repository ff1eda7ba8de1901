"""Lightning's own DDP under this project's launch policy: the reference every plugin is
compared with (tests, benchmarks, the check, notebooks).

Lightning's ``ddp_fork``/``ddp_notebook`` fork every rank with ``cores // ranks`` threads,
which hangs on a many-core machine once the parent has used OpenMP, and cannot run after
CUDA or autograd's device threads started in the parent. :class:`LightningDDPStrategy`
keeps torch's ``DistributedDataParallel`` wrapper and gradient sync, and starts its ranks
like every lightning_par strategy.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.strategies import DDPStrategy

from lightning_par import _compat
from lightning_par.strategies._base import ParStrategy


class LightningDDPStrategy(ParStrategy):
    """torch ``DistributedDataParallel`` (Lightning's ``DDPStrategy``), launched safely.

    Args:
        **kwargs: :class:`~lightning_par.strategies._base.ParStrategy`'s options, plus
            any ``DistributedDataParallel`` keyword (``find_unused_parameters``,
            ``bucket_cap_mb``, ``static_graph``, ...).
    """

    strategy_name = "lightning_ddp"

    def __init__(self, **kwargs: Any) -> None:
        own = set(ParStrategy.option_names())
        ddp_kwargs = {k: kwargs.pop(k) for k in list(kwargs) if k not in own}
        super().__init__(**kwargs)
        _compat.set_ddp_kwargs(self, ddp_kwargs)

    def sync_model_states(self) -> None:
        # (DistributedDataParallel also does it when fitting)
        _compat.sync_module_states(self.model)

    def configure_sync(self) -> None:
        DDPStrategy.configure_ddp(self)


def reference_ddp(**kwargs: Any) -> LightningDDPStrategy:
    """Lightning's DDP under the launch policy; use it instead of ``"ddp_fork"`` or
    ``"ddp_notebook"`` (also registered as ``strategy="lightning_ddp"``)."""
    return LightningDDPStrategy(**kwargs)
