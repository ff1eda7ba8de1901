"""Model state per rank at ``p`` devices, from formulas (not simulated, not measured).

ZeRO (Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models", SC 2020, arXiv:1910.02054, section 5 and figure 1): with ``P`` bytes of parameters,
as many of gradients (the same dtype) and ``O`` bytes of optimizer state for the whole
model, a data-parallel rank holds ``P + P + O``; ZeRO's stages divide the terms they shard by
``p``:

=========  ==============  ==============  ==========
stage      parameters      gradients       optimizer
=========  ==============  ==============  ==========
1          ``P``           ``P``           ``O / p``
2          ``P``           ``P / p``       ``O / p``
3          ``P / p``       ``P / p``       ``O / p``
=========  ==============  ==============  ==========

(fp32 with Adam, ``Ψ`` parameters: ``P = 4Ψ`` and ``O = 8Ψ``, its two moments; SGD with
momentum keeps ``O = 4Ψ``). ``P`` is the compared model's, ``O`` the measured run's: the
fullest rank's optimizer state times its ``world`` ranks, since every stage shards it. Left
out, as the paper's table leaves them out: activations, the units a stage-3 rank has
gathered at the moment (its current layer and the next, prefetched), the buffers in flight.
Only ``zero`` has a memory model here; the other strategies' rows say none.
"""

from __future__ import annotations

from lightning_par.simulate.profile import Profile

#: Which terms each stage divides by ``p``.
SHARDED = {1: ("optimizer",), 2: ("gradients", "optimizer"),
           3: ("parameters", "gradients", "optimizer")}  # fmt: skip


def zero_state_bytes(param_bytes: float, optimizer_bytes: float, stage: int,
                     p: int) -> dict[str, float]:  # fmt: skip
    """Bytes of parameters, gradients and optimizer state one rank holds at ZeRO ``stage``
    on ``p`` ranks, for a model of ``param_bytes`` whose optimizer keeps ``optimizer_bytes``
    (both whole), and their ``total``."""
    whole = {"parameters": param_bytes, "gradients": param_bytes, "optimizer": optimizer_bytes}
    out = {k: v / p if k in SHARDED[stage] else v for k, v in whole.items()}
    return {**out, "total": sum(out.values())}


def state_bytes_per_rank(prof: Profile, p: int) -> float | None:
    """The formula's bytes per rank of ``prof``'s strategy at ``p`` (``None``: not
    modelled)."""
    if prof.family != "zero" or not prof.grad_bytes:
        return None
    whole_optimizer = prof.optimizer_bytes * prof.world  # every stage shards it
    stage = int(prof.options.get("stage", 3))
    return zero_state_bytes(prof.grad_bytes, whole_optimizer, stage, p)["total"]
