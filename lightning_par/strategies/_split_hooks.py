"""The Lightning hooks through which every strategy hands the model to its splitter, written
once and installed on :class:`~lightning_par.strategies._base.ParStrategy`.

* the four steps run with the splitter's piece of the model in place
  (``splitter.running()``), the training step after the splitter has seen the batch;
* ``backward`` and the optimiser step, bracketed by the splitter's own halves (a pipeline
  stage's backward, a gathered norm);
* the data each rank reads: a model split over the ranks is one replica, whose every rank
  reads the whole batch;
* checkpoints in one process's format: the splitter gathers the whole state dict and
  optimiser state, and cuts a loaded one into this rank's piece; after a fork launch the
  script's checkpoint merges rank 0's training state, carried back at the end of ``fit``
  (:mod:`._carry_back`).

:func:`splitter_hooks` *installs* them (as :func:`._ps_hooks.server_group_hooks` installs
the server group's): each is afterwards a plain method of the decorated class, marked
``@override``, whose ``super()`` is that class's. A strategy overrides one as usual.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import nullcontext
from typing import Any, TypeVar

import torch

from lightning_par.strategies._carry_back import dump_rank_checkpoint, with_training_state
from lightning_par.strategies._install import install_hooks

S = TypeVar("S", bound=type)
Base = Callable[[Any], Any]

#: The step hooks run with the splitter's piece of the model in place.
STEPS = ("training_step", "validation_step", "test_step", "predict_step")


def splitter_hooks(cls: S) -> S:
    """Class decorator: give ``cls`` (a ``DDPStrategy`` holding ``self.splitter``, a
    :class:`~lightning_par.components.splitter.ModelSplitter`) the hand-offs below."""

    def base(self: Any) -> Any:
        return super(cls, self)  # what super() means in the body of cls

    hooks = {**_step_hooks(base), **_checkpoint_hooks(base)}
    install_hooks(cls, hooks, "splitter_hooks", ours={"holds_whole_model"})
    return cls


def _step_hooks(base: Base) -> dict[str, Any]:
    """The data each rank reads, the four steps, backward and the optimiser step."""

    @property  # type: ignore[misc]
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Lightning's convention for which samples this rank reads: the data-parallel size
        and rank. A model split over the ranks (pipeline, tensor parallel) is one replica
        whose every rank reads the whole batch, as Lightning's ``ModelParallelStrategy``
        reports; a loader sharded by these kwargs then reads what one process would."""
        if self.shards_data:
            return base(self).distributed_sampler_kwargs
        return {"num_replicas": 1, "rank": 0}

    def split_step(hook: str) -> Any:
        def step(self, *args: Any, **kwargs: Any) -> Any:
            if hook == "training_step":
                self.splitter.before_training_step(args[0] if args else kwargs.get("batch"))
            with self.splitter.running():
                return getattr(base(self), hook)(*args, **kwargs)

        step.__name__ = hook
        return step

    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any):
        self.splitter.before_backward(closure_loss)  # before a GradScaler scales it
        closure_loss = base(self).backward(closure_loss, optimizer, *args, **kwargs)
        self.splitter.after_backward()
        return closure_loss

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any):
        output = base(self).optimizer_step(optimizer, closure, model, **kwargs)
        self.splitter.after_optimizer_step(optimizer)
        return output

    return {
        "distributed_sampler_kwargs": distributed_sampler_kwargs,
        **{hook: split_step(hook) for hook in STEPS},
        "backward": backward,
        "optimizer_step": optimizer_step,
    }


def _checkpoint_hooks(base: Base) -> dict[str, Any]:
    """Checkpoints in one process's format, and the end of ``fit`` of a fork launch."""

    @property  # type: ignore[misc]
    def holds_whole_model(self) -> bool:
        """True in the script's process after a fork launch: no rank was set up here and the
        model holds the whole network, brought back from the ranks."""
        return self.comm is None

    def on_train_end(self) -> None:
        base(self).on_train_end()
        launcher = self.launcher
        if getattr(launcher, "carries_back", False) and not self.holds_whole_model:
            # while every component (servers, stages) is still up: the script gets it
            with self.trace.left_out() if self.trace is not None else nullcontext():
                trainer = self.lightning_module.trainer
                self.end_of_fit_checkpoint = dump_rank_checkpoint(trainer)

    def lightning_module_state_dict(self) -> dict[str, Any]:
        whole = base(self).lightning_module_state_dict()
        return whole if self.holds_whole_model else self.splitter.full_state_dict(whole)

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        if self.holds_whole_model:  # the script's checkpoint: rank 0's training state too
            checkpoint = with_training_state(checkpoint, self.training_state)
        base(self).save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        state = self.splitter.piece_state_dict(checkpoint["state_dict"])
        base(self).load_model_state_dict({**checkpoint, "state_dict": state}, strict=strict)

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        whole = base(self).optimizer_state(optimizer)
        return self.splitter.full_optimizer_state(whole, optimizer)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        if not self.splitter.load_optimizer_states(self.optimizers, checkpoint["optimizer_states"]):
            base(self).load_optimizer_state_dict(checkpoint)

    return {
        "holds_whole_model": holds_whole_model,
        "on_train_end": on_train_end,
        "lightning_module_state_dict": lightning_module_state_dict,
        "save_checkpoint": save_checkpoint,
        "load_model_state_dict": load_model_state_dict,
        "optimizer_state": optimizer_state,
        "load_optimizer_state_dict": load_optimizer_state_dict,
    }
