"""What the lightning-par command prints: none of Lightning's known noise, one early
estimate of the fit's duration, and the whole model's size under a splitting strategy."""

import logging
import subprocess
import sys
import warnings
from types import SimpleNamespace

import pytest

from lightning_par.cli import main
from lightning_par.quiet import quiet_lightning
from lightning_par.summary import FitTimeEstimate

# The start of each message filtered (the texts a 2-rank fit printed before).
NOISE = [
    "`tensorboardX` has been removed",
    "💡 Tip",
    "litlogger",
    "litmodels",
    "LeafSpec",
    "Using `DistributedSampler` with the dataloaders",
]

TINY = [
    "fit", "--model=CifarCNN", "--model.width=8", "--model.num_blocks=1",
    "--data.source=synthetic", "--data.batch_size=32", "--trainer.accelerator=cpu",
    "--trainer.enable_progress_bar=false",
]  # fmt: skip


def _run(args, tmp_path):
    return subprocess.run(
        [sys.executable, "-m", "lightning_par", *TINY, *args,
         f"--trainer.default_root_dir={tmp_path}"],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip


def test_a_two_rank_fit_and_test_print_none_of_the_known_noise(tmp_path):
    args = ["--data.synthetic_size=256", "--trainer.devices=2", "--trainer.max_epochs=1"]
    out = _run([*args, "--trainer.strategy=ring_allreduce"], tmp_path)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-3000:]
    assert "test_acc=" in text  # the test after fit ran: its sampler warning would show
    for noise in NOISE:
        assert noise not in text, noise


def test_gpipe_summary_counts_the_whole_model(tmp_path):
    from lightning.pytorch.utilities.model_summary import get_human_readable_count

    from lightning_par.models import CifarCNN

    whole = sum(p.numel() for p in CifarCNN(width=8, num_blocks=1).parameters())
    out = _run(["--data.synthetic_size=128", "--trainer.devices=2", "--trainer.strategy=gpipe",
                "--trainer.max_steps=1", "--test_after_fit=false"], tmp_path)  # fmt: skip
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-3000:]
    total = [ln for ln in text.splitlines() if ln.endswith("Total params")]
    assert len(total) == 1, text[-3000:]
    assert total[0].startswith(get_human_readable_count(whole) + " "), (total, whole)


def test_quiet_lightning_filters_only_the_known_messages():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_lightning()
        quiet_lightning()  # idempotent: no second copy of each filter
        warnings.warn(
            "Starting from v1.9.0, `tensorboardX` has been removed as a dep", stacklevel=1
        )
        warnings.warn(
            "`isinstance(treespec, LeafSpec)` is deprecated, use", FutureWarning, stacklevel=1
        )
        warnings.warn("Something else about tensorboardX", UserWarning, stacklevel=1)
        warnings.warn("`isinstance(treespec, LeafSpec)` is deprecated", UserWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == [
        "Something else about tensorboardX",
        "`isinstance(treespec, LeafSpec)` is deprecated",  # other category: kept
    ]
    assert sum("tensorboardX" in str(f[1]) for f in warnings.filters if f[1]) <= 1

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    logger.addHandler(handler)
    try:
        logger.warning(
            "💡 Tip: For seamless cloud uploads and versioning, try installing [litmodels](x)"
        )
        logger.warning("GPU available: False, used: False")
    finally:
        logger.removeHandler(handler)
    assert [r.getMessage() for r in records] == ["GPU available: False, used: False"]


@pytest.fixture
def _plain_argv(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["lightning-par"])


@pytest.mark.usefixtures("_plain_argv")
def test_a_fit_prints_exactly_one_estimate(tmp_path, capsys):
    # 1024 synthetic images, 10 % held out: 922 = 28 x 32 + 26 -> 28 full batches an epoch.
    main([*TINY, "--data.synthetic_size=1024", "--trainer.max_epochs=2",
          "--test_after_fit=false", f"--trainer.default_root_dir={tmp_path}"])  # fmt: skip
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "lightning_par estimate" in ln]
    assert len(lines) == 1, lines
    assert "2 epochs x 28 batches + validation" in lines[0] and "should take about" in lines[0]


@pytest.mark.usefixtures("_plain_argv")
def test_a_fit_shorter_than_the_measured_batches_prints_no_estimate(tmp_path, capsys):
    main([*TINY, "--data.synthetic_size=256", "--trainer.max_epochs=1",
          "--test_after_fit=false", f"--trainer.default_root_dir={tmp_path}"])  # fmt: skip
    out = capsys.readouterr().out
    assert "lightning_par summary" in out and "lightning_par estimate" not in out


def test_the_estimate_adds_every_epoch_and_validation():
    trainer = SimpleNamespace(
        num_training_batches=100, max_epochs=3, max_steps=-1, accumulate_grad_batches=1,
        num_val_batches=[10], val_check_batch=100, check_val_every_n_epoch=1,
    )  # fmt: skip
    estimate = FitTimeEstimate(after_batches=20)
    estimate._seen, estimate.train_batches, estimate.train_seconds = 20, 19, 1.9  # 0.1 s each
    estimate.val_batches, estimate.val_seconds = 2, 0.5  # 0.25 s each
    # 300 training batches x 0.1 s + 3 validations x 10 batches x 0.25 s = 37.5 s
    line = estimate.estimate_line(trainer, elapsed=2.0)
    assert "10.0 training batches/s" in line and "3 epochs x 100 batches" in line
    assert "about 38 s" in line
    trainer.max_steps = 50  # stops after 50 batches: 5 s + 1 validation run (2.5 s)
    assert "about 8 s" in estimate.estimate_line(trainer, elapsed=2.0)
