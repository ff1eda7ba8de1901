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
from lightning_par.components.strategy_options import option_names
from lightning_par.strategies._base import ParStrategy


class LightningDDPStrategy(ParStrategy):
    """torch ``DistributedDataParallel`` (Lightning's ``DDPStrategy``), launched safely.

    Args:
        find_unused_parameters: DDP's: parameters that get no gradient in a step are allowed.
        static_graph: DDP's: the graph is the same every step.
        gradient_as_bucket_view: DDP's: gradients are views into the communication buckets.
        bucket_cap_mb: DDP's bucket size in MiB (``None``: DDP's 25).
        broadcast_buffers: DDP's: rank 0's buffers are sent to every rank each forward.
        **kwargs: :class:`~lightning_par.strategies._base.ParStrategy`'s options, plus
            any other ``DistributedDataParallel`` keyword (from Python).
    """

    strategy_name = "lightning_ddp"

    def __init__(
        self,
        find_unused_parameters: bool = False,
        static_graph: bool = False,
        gradient_as_bucket_view: bool = False,
        bucket_cap_mb: float | None = None,
        broadcast_buffers: bool = True,
        **kwargs: Any,
    ) -> None:
        # The common DDP options are declared (the command line reads signatures); each is
        # passed on only when it differs from DDP's default, as an undeclared one would be.
        declared = {
            "find_unused_parameters": (find_unused_parameters, False),
            "static_graph": (static_graph, False),
            "gradient_as_bucket_view": (gradient_as_bucket_view, False),
            "bucket_cap_mb": (bucket_cap_mb, None),
            "broadcast_buffers": (broadcast_buffers, True),
        }
        own = set(option_names(ParStrategy))
        ddp_kwargs = {k: kwargs.pop(k) for k in list(kwargs) if k not in own}
        ddp_kwargs |= {k: v for k, (v, default) in declared.items() if v != default}
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
