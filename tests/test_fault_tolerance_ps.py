"""``parameter_server(fault_tolerant=True)``: a lost worker is survived with one process's
weights, whatever Lightning features the grid switches on (worker 0 too: the servers outlive
it and the first survivor takes over its share); what it cannot keep exact is refused
before launch.

The product as users run it, as in :mod:`test_fault_tolerance` (whose script, runner and
one-process reference this file shares): ``python _fault_tolerant_script.py
parameter_server`` in a subprocess, one server and its standby, a worker killed or frozen at
a step by ``LIGHTNING_PAR_FAULT``, then ``save_checkpoint`` and ``validate``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _fault_tolerant_script import DEAD_PEER_S, VARIANTS, Tiny, data  # noqa: E402
from test_fault_tolerance import (  # noqa: E402
    _assert_one_process,
    _at,
    assert_logged_whole,
    run_script,
)

PS_SURVIVED = [  # (workers, fault, launch, what the script switches on): one server + standby
    # worker 0's BatchNorm statistics stay its own batches' (the lost worker's batches it
    # trains update none of them), as without the loss; the lost worker's gradient of step 5
    # is computed during the validation that ends the epoch, in the step's train mode
    (2, "kill:rank=1:step=5", "fork", "batchnorm"),
    # bf16-mixed's gradients summed per batch in fp32; the learning-rate schedulers (per
    # step, and per epoch: the epoch ends right after the loss) stay one process's
    (2, "freeze:rank=1:step=5", "fork", "bf16_schedulers"),
    (2, "kill:rank=1:step=11", "popen", "tiny"),  # the last step
    (2, "kill:rank=1:step=1", "fork", "torchvision"),  # shufflenet (BatchNorm) as self.model
    # worker 0: the servers outlive it, worker 1 pushes its gradient and trains its batches,
    # takes over its CSV rows and checkpoints, and sends the results to the script
    (2, "kill:rank=0:step=5", "fork", "logged"),
    (2, "kill:rank=0:step=11", "fork", "logged"),  # the last step: last.ckpt at step 12
    # (three workers losing worker 0, 1 or 2 at step 5: the bit-for-bit test below)
    (3, "freeze:rank=0:step=5", "fork", "tiny"),  # ended by a peer's heartbeat, then the same
]


@pytest.mark.parametrize("world, fault, launch, variant", PS_SURVIVED, ids=["-".join(
    (str(w), *f.split(":"), la, v)) for w, f, la, v in PS_SURVIVED])  # fmt: skip
def test_a_lost_parameter_server_worker_is_survived_with_one_process_weights(
    tmp_path, world, fault, launch, variant
):
    """ParameterServerStrategy(fault_tolerant=True): the servers keep the lost worker's
    pushes, worker 0 pushes what is missing of its step and trains its batches from then
    on; then save_checkpoint and validate (popen: in the same processes, over the
    survivors) as users call them."""
    env = {"LIGHTNING_PAR_START_METHOD": launch} if launch != "fork" else {}
    run = run_script(tmp_path, "parameter_server", world, fault, variant, **env)
    detect_s, worst = _assert_survived(run, world, fault, variant)
    if VARIANTS[variant].logged:
        assert_logged_whole(tmp_path, VARIANTS[variant].steps)
    print(f"parameter_server W={world} {fault} {launch} {variant}: went on {detect_s:.2f} s "
          f"after it; weights within {worst:.1e} of one process")  # fmt: skip


def _assert_survived(run, world: int, fault: str, variant: str = "tiny") -> tuple[float, float]:
    """The lost worker named once by its launcher and once as the first survivor pushed its
    gradient, found within its bound, and the run ended with one process's weights: the
    seconds from the fault to the line, and the largest difference from one process."""
    text = "".join(line for _, line in run.lines)
    lost = fault.split(":")[1].split("=")[1]
    said = f"worker {lost} (rank {lost}) was killed by SIGKILL; the other workers go on without it"
    assert text.count(said) == 1, text[-4000:]
    leader = 1 if lost == "0" else 0  # (the first survivor)
    pushed = f"worker {lost} (rank {lost}) lost; worker {leader} pushed its gradient"
    assert text.count(pushed) == 1, text
    frozen = fault.startswith("freeze")
    assert text.count("it is ended and the others go on without it") == frozen, text[-4000:]
    detect_s = _at(run, "the other workers go on") - _at(run, "LIGHTNING_PAR_FAULT: ")
    assert detect_s < (DEAD_PEER_S + 8 if frozen else 8), detect_s
    return detect_s, _assert_one_process(run, world, variant)


@pytest.fixture(scope="module")
def three_workers_unharmed(tmp_path_factory) -> dict[str, torch.Tensor]:
    """The final weights of the script's run on three workers without a fault."""
    run = run_script(tmp_path_factory.mktemp("unharmed"), "parameter_server", 3, "-")
    assert run.code == 0, "".join(line for _, line in run.lines)[-4000:]
    return torch.load(run.out, weights_only=True)


@pytest.mark.parametrize("lost", [0, 1, 2], ids=["first", "middle", "last"])
def test_three_parameter_server_workers_losing_one_end_with_the_weights_of_none_lost_bit_for_bit(
    tmp_path, three_workers_unharmed, lost
):
    """With three workers or more, the order of the servers' sums shows: the first survivor
    (worker 0, or worker 1 when worker 0 is lost) pushes the lost worker's gradient in that
    worker's slot (the interrupted step's, and every one after), after its own, and each
    server sums the slots in worker order, as without the loss. Summing
    the lost worker's gradient into worker 0's push, or adding it last, gave other last
    bits from the step after the loss on (3e-8 apart after 12 steps of this net)."""
    fault = f"kill:rank={lost}:step=5"
    run = run_script(tmp_path, "parameter_server", 3, fault)
    _assert_survived(run, 3, fault)  # (and, as every survived run, one process's weights)
    got = torch.load(run.out, weights_only=True)
    apart = {k: (got[k] - v).abs().max().item() for k, v in three_workers_unharmed.items()
             if not torch.equal(got[k], v)}  # fmt: skip
    assert apart == {}, apart


def test_a_killed_parameter_server_worker_found_silent_later_is_not_called_frozen(capsys):
    """A run that outlasts ``dead_peer_timeout`` after a worker was killed finds it silent
    too: its launcher named it killed, so no second line calls it frozen (a frozen one,
    alive, is ended and named once)."""
    from lightning_par.paramserver.lost_workers import end_silent_worker

    killed: list[int] = []
    store = SimpleNamespace(compare_set=lambda key, expected, value: value.encode())
    for ended in (True, False):
        process = SimpleNamespace(
            local=True, ended=lambda e=ended: e, kill=lambda: killed.append(1)
        )
        beat = SimpleNamespace(peers={1: process}, rank=0, store=store, killing=lambda peer: None,
                               safely=lambda action: action())  # fmt: skip
        end_silent_worker(beat, 1, "worker 1 (rank 1) stopped responding for 2 s")
    said = capsys.readouterr().err
    assert said.count("it is ended and the others go on without it") == 1 and killed == [1], said


class _Manual(Tiny):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False


FT = r"^parameter_server\(fault_tolerant=True\) cannot"
REFUSED = [  # (the model, what the Trainer switches on, the message)
    (Tiny, {"accumulate_grad_batches": 2}, FT + r" accumulate gradients .* use a larger batch"),
    (Tiny, {"reload_dataloaders_every_n_epochs": 1}, FT + r" reload the data loaders every epoch"),
    (_Manual, {}, r"^parameter_server supports automatic optimisation only"),
    (Tiny, {"precision": "16-true"}, r"^parameter_server runs precision '32-true' or 'bf16-mixed'"),
]


@pytest.mark.parametrize("model, option, refused", REFUSED, ids=[
    "accumulate", "reload_dataloaders", "manual", "16-true"])  # fmt: skip
def test_what_a_lost_parameter_server_worker_would_leave_inexact_is_refused_before_launch(
    model, option, refused
):
    """Refused in the script's process, naming the plugin, the feature and the fix, before
    any rank or server starts."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    from lightning_par.strategies import ParameterServerStrategy

    trainer = pl.Trainer(
        strategy=ParameterServerStrategy(fault_tolerant=True), accelerator="cpu", devices=2,
        max_steps=1, logger=False, enable_progress_bar=False, enable_checkpointing=False,
        **option,
    )  # fmt: skip
    with pytest.raises(ValueError, match=refused):
        trainer.fit(model(), DataLoader(data(), batch_size=4))


def test_worker_0_lost_under_popen_is_taken_over_by_the_first_survivor(tmp_path):
    """Under popen worker 0 runs behind the script's keeper, which holds the job's store:
    the servers outlive worker 0 there too, worker 1 takes over its share, and the run
    ends with one process's weights, no traceback and nothing left."""
    run = run_script(tmp_path, "parameter_server", 3, "kill:rank=0:step=4",
                     LIGHTNING_PAR_START_METHOD="popen")  # fmt: skip
    text = "".join(line for _, line in run.lines)
    said = "worker 0 (rank 0) was killed by SIGKILL; the other ranks go on without it"
    assert text.count(said) == 1, text[-4000:]
    assert text.count("worker 0 (rank 0) lost; worker 1 pushed its gradient") == 1, text
    _assert_one_process(run, 3)


def test_worker_0_lost_then_another_leaves_the_last_survivor_the_weights_of_none_lost(
    tmp_path, three_workers_unharmed
):
    """Worker 0 lost at step 4, then worker 2 at step 8: worker 1, the leader since the
    first loss, pushes both lost workers' gradients in their slots and ends alone with the
    weights of the run that lost none, bit for bit; save_checkpoint and validate after."""
    run = run_script(tmp_path, "parameter_server", 3, "kill:rank=0:step=4,kill:rank=2:step=8")
    text = "".join(line for _, line in run.lines)
    for lost, step in ((0, 4), (2, 8)):
        pushed = f"worker {lost} (rank {lost}) lost; worker 1 pushed its gradient of step {step}"
        assert text.count(pushed) == 1, text[-4000:]
        said = f"worker {lost} (rank {lost}) was killed by SIGKILL; the other workers go on"
        assert text.count(said) == 1, text[-4000:]
    _assert_one_process(run, 3)
    got = torch.load(run.out, weights_only=True)
    apart = {k: (got[k] - v).abs().max().item() for k, v in three_workers_unharmed.items()
             if not torch.equal(got[k], v)}  # fmt: skip
    assert apart == {}, apart
