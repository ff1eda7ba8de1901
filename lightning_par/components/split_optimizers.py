"""Optimisers a model split over ranks cannot step as one process does, refused at setup.

Each rank of a split model steps the user's optimiser on the parameters it holds: whole
stages (``gpipe``, ``layerwise``, ``hybrid``'s rows) or slices of the cut layers
(``tensor_parallel``). An update computed from each element's own gradient and state (SGD,
Adam, AdamW, ...) is then one process's update; one that reads more than that is not, and
the run would end normally with other weights. So these are stopped by name when ``fit``
sets up, before the first step:

* LBFGS (Liu and Nocedal, 1989) reads the whole model: its line search takes norms and dot
  products over every parameter's gradient and step, and calls the closure several times a
  step, so a rank holding some stages or slices would search along its part alone;
* Adafactor (Shazeer and Stern, 2018) factors each matrix's second moment into row and
  column means, and Muon orthogonalises each weight matrix: both read whole tensors, which
  a rank holding stages has but a tensor-parallel slice does not.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

#: torch.optim name -> why a rank holding part of the model cannot step it
WHOLE_MODEL = {
    "LBFGS": "its line search takes norms and dot products over every parameter's gradient "
    "and calls the closure several times a step",
}
WHOLE_TENSOR = {
    "Adafactor": "it factors each weight matrix's second moment into row and column means",
    "Muon": "it orthogonalises each whole weight matrix",
}


def refuse_optimizers(
    optimizers: Iterable[Any], who: str, holds: str, refused: Mapping[str, str]
) -> None:
    """Raise ``ValueError`` naming ``who`` for an optimiser of ``refused`` (name -> why),
    or a subclass of one; each rank steps on ``holds`` only."""
    for optimizer in optimizers:
        inner = getattr(optimizer, "optimizer", optimizer)  # a LightningOptimizer's
        for name, why in refused.items():
            cls = getattr(torch.optim, name, None)  # (Adafactor and Muon: recent torch)
            if cls is None or not isinstance(inner, cls):
                continue
            raise ValueError(
                f"{who} cannot run {type(inner).__name__}: each rank steps the optimiser on "
                f"{holds} only, and {why}, so the run would end with other weights than one "
                "process's. Use an optimiser that updates each parameter from its own "
                "gradient (SGD, Adam, AdamW, ...), or a data-parallel strategy "
                f"(ring_allreduce) for {name}"
            )
