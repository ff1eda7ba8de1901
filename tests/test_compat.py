"""Every private Lightning/torch name in lightning_par/_compat/ still exists and still
does what lightning_par relies on; an upgrade that moves one fails here, by name. (The
names of Lightning's loops, ``_compat/loops.py``: ``test_compat_loops.py``.)"""

from __future__ import annotations

import inspect
import warnings

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelSummary

from lightning_par import _compat


def _trainer(**kwargs) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, **kwargs,
    )  # fmt: skip


def test_a_moved_name_is_a_clear_error() -> None:
    with pytest.raises(_compat.CompatError, match=r"torch\.nn\._no_such_name.*needed by me"):
        _compat.private("torch.nn", "_no_such_name", "needed by me")
    missing = _compat.private_class("torch.nn", "_NoSuchLauncher", "a launch")
    with pytest.raises(_compat.CompatError, match="_NoSuchLauncher is missing"):
        type("Sub", (missing,), {})()
    with pytest.raises(_compat.CompatError, match=r"_broadcast_sigterm_tensor is missing"):
        _compat.replace_sigterm_broadcast(_FakeTrainer(), lambda: None)


class _LoopThatBroadcasts:
    """A future Lightning loop that broadcasts under another name."""

    def advance(self) -> None:
        torch.distributed.broadcast(torch.zeros(1), src=0)


class _FakeTrainer:
    class fit_loop:  # noqa: N801
        epoch_loop = _LoopThatBroadcasts()


def test_default_store_and_module_sync(tmp_path) -> None:
    init = f"file://{tmp_path / 'store'}"
    torch.distributed.init_process_group("gloo", init_method=init, rank=0, world_size=1)
    try:
        store = _compat.default_store()
        store.set("k", "v")
        assert store.get("k") == b"v"
        module = torch.nn.Linear(2, 2)
        before = module.weight.detach().clone()
        _compat.sync_module_states(module)  # one rank: its own weights
        assert torch.equal(module.weight, before)
    finally:
        torch.distributed.destroy_process_group()


def test_start_processes_patch_reaches_lightnings_launch() -> None:
    from lightning.pytorch.strategies.launchers import multiprocessing as lmp

    # Lightning's fork launch calls start_processes through the torch module, so patching
    # the module attribute is seen there
    assert "mp.start_processes(" in inspect.getsource(lmp._MultiProcessingLauncher.launch)
    assert lmp.mp is torch.multiprocessing
    seen = []
    original = torch.multiprocessing.start_processes
    with _compat.patched_start_processes(lambda ctx: seen.append(ctx) or ctx):
        assert torch.multiprocessing.start_processes is not original
        ctx = torch.multiprocessing.start_processes(_noop, nprocs=1, join=False,
                                                    start_method="fork")  # fmt: skip
        while not ctx.join():
            pass
    assert torch.multiprocessing.start_processes is original
    assert seen == [ctx]
    for attr in ("processes", "sentinels", "error_files"):
        assert hasattr(ctx, attr), attr


def _noop(i: int) -> None:
    pass


def test_the_popen_observer_patch_reaches_lightnings_launch() -> None:
    from lightning.pytorch.strategies.launchers import subprocess_script as lss

    # Lightning's popen launch looks the observer up in its module when it starts the
    # children, so replacing the module attribute is seen there
    assert "_launch_process_observer(self.procs)" in inspect.getsource(
        lss._SubprocessScriptLauncher.launch
    )
    original, seen = lss._launch_process_observer, []
    with _compat.replaced_process_observer(seen.append):
        lss._launch_process_observer(["child"])
    assert seen == [["child"]]
    assert lss._launch_process_observer is original


def test_mark_optimizer_stepped_silences_the_scheduler_warning() -> None:
    from lightning.pytorch.core.optimizer import LightningOptimizer

    def scheduler_warnings(mark: bool) -> list[str]:
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        sched = torch.optim.lr_scheduler.StepLR(opt, 1)
        if mark:  # through Lightning's wrapper, as the strategy gets it
            _compat.mark_optimizer_stepped(LightningOptimizer(opt))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            sched.step()
        return [str(w.message) for w in caught if "optimizer.step()" in str(w.message)]

    assert scheduler_warnings(False), "torch no longer warns: the test cannot see the mark"
    assert scheduler_warnings(True) == []


def test_precision_after_closure_runs_the_hooks() -> None:
    seen = []

    class Module(pl.LightningModule):
        def on_before_optimizer_step(self, optimizer) -> None:
            seen.append(optimizer)

    trainer = _trainer()
    module = Module()
    module._trainer = trainer
    trainer.strategy.connect(module)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    _compat.after_closure(trainer.precision_plugin, module, opt)
    assert seen == [opt]


def test_lightning_helpers_exist() -> None:
    module = torch.nn.Linear(2, 2)
    assert _compat.default_process_group_backend(torch.device("cpu")) == "gloo"
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    _compat.optimizers_to_device([opt], torch.device("cpu"))
    for cls in (_compat.SubprocessScriptLauncher, _compat.MultiProcessingLauncher,
                _compat.WorkerOutput):  # fmt: skip
        assert cls.__module__.startswith("lightning.pytorch.strategies.launchers"), cls
    assert hasattr(_compat.MultiProcessingLauncher, "_wrapping_function")
    trainer = _trainer()
    _compat.set_use_distributed_sampler(trainer, False)
    assert _compat.uses_distributed_sampler(trainer) is False
    assert trainer._accelerator_connector.use_distributed_sampler is False


def test_logger_helpers_a_survivor_taking_over_rank_0_uses(tmp_path) -> None:
    from lightning.pytorch.loggers import CSVLogger

    logger = CSVLogger(tmp_path)
    assert _compat.logger_version_field(logger) == "_version"
    setattr(logger, _compat.logger_version_field(logger), 7)
    assert logger.version == 7
    trainer = pl.Trainer(logger=logger, enable_progress_bar=False, enable_model_summary=False)
    module = pl.LightningModule()
    module.save_hyperparameters({"width": 3})
    trainer.strategy.connect(module)
    module.trainer = trainer
    _compat.log_hyperparameters(trainer)  # what rank 0 logs as fit begins
    assert "width: 3" in (tmp_path / "lightning_logs" / "version_7" / "hparams.yaml").read_text()


def test_attached_trainer() -> None:
    module = pl.LightningModule()
    assert _compat.attached_trainer(module) is None and _compat.attached_trainer(None) is None
    trainer = _trainer()
    trainer.strategy.connect(module)
    module.trainer = trainer
    assert _compat.attached_trainer(module) is trainer


def test_model_summary_names() -> None:
    callback = ModelSummary(max_depth=3)
    depth, options = _compat.model_summary_options(callback)
    assert depth == 3 and isinstance(options, dict)
    from lightning.pytorch.utilities.model_summary import ModelSummary as Summary

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(2, 3)

    rows = dict(_compat.summary_data(Summary(Module(), max_depth=1)))
    assert rows["Name"] == ["layer"] and rows["Type"] == ["Linear"]


def test_scaler_found_inf_flags() -> None:
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    model.weight.grad.fill_(float("inf"))
    scaler.unscale_(optimizer)
    flags = _compat.scaler_found_inf(scaler, optimizer)
    assert flags and all(float(f) == 1.0 for f in flags.values())


def test_in_backward_pass() -> None:
    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            seen.append(_compat.in_backward_pass())
            return grad

    x = torch.ones(2, requires_grad=True)
    assert _compat.in_backward_pass() is False
    Probe.apply(x).sum().backward()
    assert seen == [True]


def test_disable_module_memory_sharing_copies_shared_tensors() -> None:
    module = torch.nn.Linear(2, 2)
    module.share_memory()
    assert module.weight.is_shared()
    (copy,) = _compat.disable_module_memory_sharing((module,))
    assert not copy.weight.is_shared()
    assert torch.equal(copy.weight, module.weight)


def test_strategy_private_fields() -> None:
    from datetime import timedelta

    from lightning.pytorch.strategies import DDPStrategy

    strategy = DDPStrategy(timeout=timedelta(seconds=7), process_group_backend="gloo")
    assert _compat.strategy_timeout(strategy) == timedelta(seconds=7)
    assert _compat.process_group_backend(strategy) == "gloo"
    _compat.set_process_group_backend(strategy, "nccl")
    assert strategy._process_group_backend == "nccl"
    assert _compat.layer_sync(strategy) is None
    _compat.set_ddp_kwargs(strategy, {"find_unused_parameters": True})
    assert strategy._ddp_kwargs == {"find_unused_parameters": True}
    pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, sync_batchnorm=True, logger=False)
    assert _compat.layer_sync(strategy) is not None  # Trainer(sync_batchnorm=True) sets it
    with pytest.raises(_compat.CompatError, match="DDPStrategy._timeout is missing"):
        _compat.strategy_timeout(object())


def test_clip_grad_by_norm_replacement_is_what_lightning_calls() -> None:
    from lightning.pytorch.plugins.precision import Precision
    from lightning.pytorch.utilities.enums import GradClipAlgorithmType

    precision = Precision()
    seen = []
    _compat.replace_clip_grad_by_norm(precision, lambda opt, val: seen.append((opt, val)))
    opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    precision.clip_gradients(opt, 0.5, GradClipAlgorithmType.NORM)
    assert seen == [(opt, 0.5)]
