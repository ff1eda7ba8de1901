"""The launch policy: every failure condition a many-core or GPU machine brings, reproduced
on a 2-core CPU machine (a parent with a multi-threaded OpenMP pool, ranks that would be
given several threads, CUDA or autograd device threads faked), and the policy's answer."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings

import pytest

from lightning_par.comm import run_on_ranks
from lightning_par.launch import policy as launch
from lightning_par.launch.policy import LaunchError, ProcessState, plan_launch
from lightning_par.launch.processes import run_bounded

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def state(**kw) -> ProcessState:
    facts = dict(
        cuda_initialized=False, autograd_threads=False, interactive=False,
        under_pytest=False, external_ranks=False, cores=16,
    )  # fmt: skip
    facts.update(kw)
    return ProcessState(**facts)


def test_scripts_fork_only_with_one_core_per_rank_and_a_clean_parent():
    assert plan_launch("cpu", 16, state=state()).method == "fork"
    assert plan_launch("cpu", 4, state=state()).method == "popen"
    assert plan_launch("cuda", 16, state=state()).method == "popen"
    assert plan_launch("cpu", 2, state=state(cores=2)).method == "fork"
    assert plan_launch("cpu", 1, state=state(cores=2)).method == "popen"
    # CUDA initialised or autograd's device threads running: fresh processes, always
    assert plan_launch("cpu", 16, state=state(cuda_initialized=True)).method == "popen"
    assert plan_launch("cpu", 16, state=state(autograd_threads=True)).method == "popen"
    assert plan_launch("cpu", 2, state=state(external_ranks=True)).method == "external"


def test_processes_of_a_rank_start_whoever_started_the_rank(monkeypatch):
    # parameter servers under torchrun/SLURM/popen: once "external", a ValueError at start
    ext = state(external_ranks=True)
    assert plan_launch("cpu", 2, state=ext, can_exec=False).method == "fork"
    assert plan_launch("cpu", 2, state=state(external_ranks=True, cuda_initialized=True),
                       can_exec=False).method == "forkserver"  # fmt: skip
    monkeypatch.setenv("LIGHTNING_PAR_START_METHOD", "popen")  # asked of the Lightning launch
    assert plan_launch("cpu", 2, state=ext, can_exec=False).method == "fork"


def test_an_interactive_slurm_allocation_has_no_ranks_yet(monkeypatch):
    for key in [k for k in os.environ if k.startswith("SLURM_")] + ["LOCAL_RANK", "WORLD_SIZE"]:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("SLURM_NTASKS", "2")
    monkeypatch.setenv("SLURM_JOB_NAME", "train.sh")
    assert launch.under_cluster_launcher()  # srun started the tasks
    for name in ("bash", "interactive"):  # salloc, then Lightning starts the ranks
        monkeypatch.setenv("SLURM_JOB_NAME", name)
        assert not launch.under_cluster_launcher()


def test_forked_ranks_always_compute_on_one_thread():
    for facts in ({"interactive": True}, {"under_pytest": True}, {"cores": 2}):
        plan = plan_launch("cpu", 2, state=state(**facts))
        assert (plan.method, plan.threads_per_rank) == ("fork", 1)


def test_tests_and_run_on_ranks_use_a_clean_forkserver_when_fork_is_unsafe():
    assert plan_launch("cpu", 2, state=state(under_pytest=True)).method == "fork"
    for hazard in ({"cuda_initialized": True}, {"autograd_threads": True}):
        assert plan_launch("cpu", 2, state=state(under_pytest=True, **hazard)).method == (
            "forkserver"
        )
        assert plan_launch("cpu", 2, state=state(**hazard), can_exec=False).method == ("forkserver")


@pytest.mark.parametrize(
    "hazard, words",
    [({"cuda_initialized": True}, "CUDA is initialised"), ({"autograd_threads": True}, "autograd")],
)
def test_a_notebook_that_cannot_fork_gets_a_clear_error_before_any_process_starts(hazard, words):
    with pytest.raises(LaunchError, match=f"(?s)notebook only fork works.*{words}.*restart the"):
        plan_launch("cpu", 2, state=state(interactive=True, **hazard))
    with pytest.raises(LaunchError, match="start_method='fork' was requested"):
        plan_launch("cpu", 2, requested="fork", state=state(**hazard))


def test_requested_and_environment_start_methods(monkeypatch):
    assert plan_launch("cpu", 2, requested="spawn", state=state()).method == "spawn"
    monkeypatch.setenv("LIGHTNING_PAR_START_METHOD", "forkserver")
    assert plan_launch("cpu", 2, state=state()).method == "forkserver"
    monkeypatch.setenv("LIGHTNING_PAR_START_METHOD", "teleport")
    with pytest.raises(ValueError, match="not one of"):
        plan_launch("cpu", 2, state=state())


def test_autograd_device_threads_are_recognised_by_name(monkeypatch):
    monkeypatch.setattr(launch, "_thread_names", lambda: ["python", "pt_autograd_0"])
    assert launch.autograd_threads_started()
    monkeypatch.setattr(launch, "_thread_names", lambda: ["python", "python"])
    assert not launch.autograd_threads_started()


def _fresh_python(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "", "LIGHTNING_PAR_TIMEOUT": "20"}
    env.pop("OMP_NUM_THREADS")
    result = run_bounded([sys.executable, "-c", textwrap.dedent(code)], timeout, env=env)
    assert not result.timed_out, f"hung (killed after {timeout} s):\n{result.stderr[-3000:]}"
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_fork_launched_reference_ddp_survives_a_parent_openmp_pool_on_many_cores():
    # What hung on the 16-core machine: Lightning gives each forked rank cores // ranks
    # threads, and the parent had already run OpenMP. The core count is faked to 16 so the
    # same numbers happen here (Lightning's own ddp_fork then hangs in the ranks' first
    # convolution: checked by hand); the ranks must compute on one thread and finish.
    _fresh_python(
        """
        import os, torch
        os.cpu_count = lambda: 16
        os.sched_getaffinity = lambda pid: set(range(16))  # what Lightning counts
        import lightning.pytorch as pl
        from lightning_par.launch import policy as launch
        from lightning_par.models import CifarCNN
        from lightning_par.data import CIFAR10DataModule
        from lightning_par.strategies import reference_ddp
        launch.is_interactive = lambda: True  # a notebook: the policy must fork
        torch.set_num_threads(2)
        a = torch.randn(500, 500); (a @ a).sum()  # the parent's OpenMP pool is running

        class Threads(pl.Callback):
            def on_train_batch_end(self, trainer, *args):
                assert torch.get_num_threads() == 1, torch.get_num_threads()

        trainer = pl.Trainer(
            strategy=reference_ddp(), accelerator="cpu", devices=2, max_steps=2,
            limit_val_batches=0, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, callbacks=[Threads()],
        )
        data = CIFAR10DataModule(source="synthetic", batch_size=8, synthetic_size=64)
        trainer.fit(CifarCNN(width=8, num_blocks=1), datamodule=data)
        assert trainer.strategy.launch_plan.method == "fork"
        assert trainer.strategy.launch_plan.threads_per_rank == 1
        """,
        timeout=150,
    )


def _parent_pid(rank, world_size):
    return os.getppid()


def test_run_on_ranks_with_autograd_threads_in_the_parent_uses_a_forkserver(monkeypatch):
    # Faked: on a machine with a GPU, a backward pass here starts autograd's device
    # threads, and a forked rank's own backward would then fail.
    monkeypatch.setattr(launch, "autograd_threads_started", lambda: True)
    parents = run_on_ranks(_parent_pid, 2, timeout=60)
    assert os.getpid() not in parents  # the ranks are children of the forkserver


def test_a_reference_fit_with_cuda_initialised_in_the_parent_uses_a_forkserver(monkeypatch):
    import lightning.pytorch as pl

    from lightning_par.data import CIFAR10DataModule
    from lightning_par.models import CifarCNN
    from lightning_par.strategies import reference_ddp

    monkeypatch.setattr(launch, "cuda_initialized", lambda: True)
    trainer = pl.Trainer(
        strategy=reference_ddp(), accelerator="cpu", devices=2, max_steps=2,
        limit_val_batches=0, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    model = CifarCNN(width=8, num_blocks=1)
    before = [p.detach().clone() for p in model.parameters()]
    trainer.fit(model, datamodule=CIFAR10DataModule(source="synthetic", batch_size=8,
                                                    synthetic_size=64))  # fmt: skip
    assert trainer.strategy.launch_plan.method == "forkserver"
    assert any(not (a == b).all() for a, b in zip(before, model.parameters()))  # trained


def test_oversubscription_is_warned_about_with_its_cost():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        text = launch.warn_if_oversubscribed("cpu", (os.cpu_count() or 1) * 32)
    assert "processes on" in text and "Use devices <=" in text
    assert any("take turns on the cores" in str(w.message) for w in caught)
    assert launch.warn_if_oversubscribed("cpu", 1) == ""
    assert "share a device" in launch.warn_if_oversubscribed("cuda", 4, devices=1)
