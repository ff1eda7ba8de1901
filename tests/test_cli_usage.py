"""A typo on the lightning-par command line: one short usage error, exit code 2, no traceback."""

import subprocess
import sys

import pytest

from lightning_par.cli import main
from lightning_par.cli_checks import lightning_strategy_names, our_strategy_names
from lightning_par.strategies import strategy_specs

BASE = [
    "fit",
    "--model=CifarCNN",
    "--data.source=synthetic",
    "--trainer.accelerator=cpu",
    "--trainer.max_epochs=1",
]

# (option typed, what the message must contain); each would start training if accepted.
TYPOS = [
    ("--trainer.strategy=ring_allreduc", ["Did you mean --trainer.strategy=ring_allreduce?"]),
    ("--data.source=cifar10-mni", ["Did you mean --data.source=cifar10-mini?", "synthetic"]),
    ("--trainer.devices=0", ["--trainer.devices=0 is not a device count", ">= 1"]),
    ("--trainer.devices=-3", ["Did you mean --trainer.devices=3?"]),
    ("--trainer.devices=two", ["--trainer.devices=two is not a device count"]),
    ("--trainer.devices=0,1", ["on CPU devices is a number of processes", "devices=2"]),
    ("--trainer.accelerator=cpuu", ["Did you mean --trainer.accelerator=cpu?", "cuda"]),
    ("--model=CifarCN", ["Did you mean --model=CifarCNN?", "CifarRNN"]),
    ("--model.optimizer=adamm", ["Did you mean --model.optimizer=adam?", "sgd"]),
    ("--model.lr=0", ["--model.lr=0 must be > 0"]),
    (
        "--trainer.max_epochs=-3",
        ["must be an integer >= -1", "Did you mean --trainer.max_epochs=3?"],
    ),
    ("--trainer.limit_val_batches=-1", ["must be a batch count >= 0 or a fraction"]),
    ("--data.batch_size=0", ["--data.batch_size=0 must be an integer >= 1"]),
    ("--data.num_workers=-2", ["Did you mean --data.num_workers=2?"]),
    ("--trainer.max_epochs=abc", ["error: --trainer.max_epochs:", "abc", "fit --help"]),
]


@pytest.fixture(autouse=True)
def _plain_argv(monkeypatch):
    # main(args) beside pytest's own argv makes LightningCLI warn about both being given.
    monkeypatch.setattr(sys, "argv", ["lightning-par"])


@pytest.mark.parametrize(("typo", "expected"), TYPOS, ids=[t for t, _ in TYPOS])
def test_a_typo_is_a_short_usage_error(typo, expected, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([*BASE, f"--trainer.default_root_dir={tmp_path}", typo])
    assert exit_info.value.code == 2
    out, err = capsys.readouterr()
    assert err.startswith("lightning-par: error: "), err
    for text in expected:
        assert text in err, err
    assert len(err.splitlines()) <= 10, err
    assert "lightning_par summary" not in out  # nothing was trained
    assert not list(tmp_path.iterdir())  # no logs: no Trainer ran


def test_strategy_error_lists_our_names_first(capsys):
    with pytest.raises(SystemExit):
        main([*BASE, "--trainer.strategy=butterfly"])
    err = capsys.readouterr().err
    ours = [err.index(name) for name in our_strategy_names()]
    assert "Did you mean --trainer.strategy=butterfly_allreduce?" in err
    assert max(ours) < err.index("ddp_fork") < err.index("fsdp")


def test_our_strategy_names_come_from_the_registry():
    assert our_strategy_names() == [spec.name for spec in strategy_specs()]
    assert "ring_allreduce" in our_strategy_names() and "lightning_ddp" in our_strategy_names()
    lightning = lightning_strategy_names()
    assert "ddp" in lightning and "auto" in lightning
    assert not set(our_strategy_names()) & set(lightning)


def test_a_typo_in_a_config_file_is_caught_too(tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text("data:\n  source: syntetic\ntrainer:\n  strategy: gpip\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--model=CifarCNN", f"--config={config}"])
    assert exit_info.value.code == 2
    assert "Did you mean --trainer.strategy=gpipe?" in capsys.readouterr().err


def test_valid_values_pass_the_checks():
    from lightning_par.cli_checks import check_devices, check_limit

    for devices in (1, 4, -1, "auto", "3"):
        check_devices(devices, "cpu")
    check_devices([0, 1], "cuda")
    check_devices("0,1", "gpu")
    for limit in (0, 5, 0.25, 1.0, 2.0, None):  # jsonargparse reads "2" as 2.0
        check_limit("--trainer.limit_val_batches", limit)


def test_the_command_line_prints_no_traceback_and_starts_no_process(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "lightning_par", *BASE, "--trainer.devices=2",
         "--trainer.strategy=ring_allreduc", f"--trainer.default_root_dir={tmp_path}"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2
    assert out.stderr.startswith("python -m lightning_par: error: --trainer.strategy=ring_allreduc")
    assert "Did you mean --trainer.strategy=ring_allreduce?" in out.stderr
    assert "Traceback" not in out.stderr + out.stdout
    assert "Initializing distributed" not in out.stderr + out.stdout
