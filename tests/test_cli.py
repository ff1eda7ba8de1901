"""The lightning-par command (LightningCLI) and the check table."""

import json
import re
import subprocess
import sys
import time

import pytest

from lightning_par import check
from lightning_par.cli import main

FAST = [
    "--model=CifarCNN",
    "--model.width=8",
    "--model.num_blocks=1",
    "--data.source=synthetic",
    "--data.synthetic_size=256",
    "--data.batch_size=32",
    "--trainer.accelerator=cpu",
    "--trainer.max_epochs=1",
    "--trainer.enable_progress_bar=false",
    "--trainer.enable_model_summary=false",
]


def test_fit_on_two_processes_tests_and_prints_a_summary(tmp_path, capsys):
    main(["fit", *FAST, "--trainer.devices=2", "--trainer.strategy=lightning_ddp",
          f"--trainer.default_root_dir={tmp_path}"])  # fmt: skip
    line = [ln for ln in capsys.readouterr().out.splitlines() if "lightning_par summary" in ln]
    assert len(line) == 1, line
    summary = line[0]
    for field in ("strategy=lightning_ddp ", "processes=2", "data='synthetic'",
                  "train_images_per_s=", "test_acc="):  # fmt: skip
        assert field in summary
    assert (tmp_path / "lightning_logs").is_dir()


def test_yaml_config_and_rnn(tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text(
        "model:\n  class_path: lightning_par.models.CifarRNN\n  init_args:\n"
        "    hidden_size: 8\n    num_layers: 1\n"
        "data:\n  source: synthetic\n  synthetic_size: 128\n"
        "trainer:\n  accelerator: cpu\n  max_steps: 2\n  limit_val_batches: 1\n"
        "  enable_progress_bar: false\n"
        f"  default_root_dir: {tmp_path}\n"
        "test_after_fit: false\n"
    )
    main(["fit", f"--config={config}"])
    out = capsys.readouterr().out
    summary = [ln for ln in out.splitlines() if "lightning_par summary" in ln]
    assert len(summary) == 1 and "test_acc=" not in summary[0], out
    # no test ran: no table of test results (with rich installed, the model summary is
    # printed here too, and names the test_acc metric module)
    assert "Test metric" not in out, out


def test_a_launch_that_pickles_the_trainer_takes_the_cli_with_it(tmp_path, capsys, monkeypatch):
    # forkserver (chosen where fork is unsafe: a GPU machine after a backward pass) pickles
    # the Trainer, and Lightning's SaveConfigCallback keeps the CLI's parser
    monkeypatch.setenv("LIGHTNING_PAR_START_METHOD", "forkserver")
    main(["fit", *FAST, "--trainer.devices=2", "--trainer.strategy=ring_allreduce",
          "--trainer.max_steps=1", f"--trainer.default_root_dir={tmp_path}"])  # fmt: skip
    out = capsys.readouterr().out
    assert "strategy=ring_allreduce " in out and "processes=2" in out, out


def test_unknown_strategy_is_rejected_before_training(tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", *FAST, "--trainer.strategy=no_such_strategy",
              f"--trainer.default_root_dir={tmp_path}"])  # fmt: skip
    assert exit_info.value.code == 2  # a usage error, before any training


def test_missing_data_is_one_clear_error_before_any_process_starts(tmp_path, monkeypatch):
    monkeypatch.setenv("LIGHTNING_PAR_DATA", str(tmp_path / "empty"))
    monkeypatch.delenv("LIGHTNING_PAR_CIFAR10_MINI", raising=False)
    out = subprocess.run(
        [sys.executable, "-m", "lightning_par", "fit", "--model=CifarCNN",
         "--data.download=false", "--trainer.accelerator=cpu", "--trainer.devices=2",
         "--trainer.strategy=ring_allreduce", f"--trainer.default_root_dir={tmp_path}"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr[-2000:]
    assert "No CIFAR-10 data found" in out.stderr and "Three ways to get data" in out.stderr
    assert "--data.source=synthetic" in out.stderr
    assert "Traceback" not in out.stderr
    assert "Initializing distributed" not in out.stderr + out.stdout  # no rank was started


def test_python_m_help_names_the_command_and_lists_the_subcommands():
    out = subprocess.run(
        [sys.executable, "-m", "lightning_par", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0
    assert out.stdout.startswith("usage: python -m lightning_par ") and "__main__" not in out.stdout
    subcommands = {"fit", "validate", "test", "predict"}
    assert subcommands <= set(re.findall(r"\b(fit|validate|test|predict)\b", out.stdout)), (
        out.stdout
    )


def test_check_prints_one_ok_row_per_run(capsys):
    code = check.main(["--strategies", "lightning_ddp", "--models", "CifarCNN", "--accelerators",
                       "cpu", "--steps", "3", "--json"])  # fmt: skip
    rows = json.loads(capsys.readouterr().out)
    assert code == 0
    assert [(r["strategy"], r["processes"], r["status"]) for r in rows] == [
        ("single", 1, "ok"),
        ("lightning_ddp", 2, "ok"),
    ]
    assert [r["ran"] for r in rows] == ["single_device", "lightning_ddp"]  # as registered


def test_check_reports_a_failing_row_without_stopping(capsys):
    code = check.main(["--strategies", "no_such_strategy", "--models", "CifarRNN",
                       "--accelerators", "cpu", "--steps", "2", "--json"])  # fmt: skip
    out = capsys.readouterr().out
    rows = json.loads(out[: out.rindex("]") + 1])
    assert code == 1
    assert [r["status"] for r in rows] == ["ok", "failed"]
    assert "no_such_strategy" in rows[1]["error"]


def test_check_stops_a_row_past_its_timeout_and_goes_on(capsys):
    # one subprocess runs the accelerator's rows; a row past --timeout is stopped with its
    # ranks, reported, and the check ends instead of hanging
    start = time.monotonic()
    code = check.main(["--strategies", "ring_allreduce", "--models", "CifarCNN",
                       "--accelerators", "cpu", "--steps", "400", "--timeout", "3",
                       "--json"])  # fmt: skip
    out = capsys.readouterr().out
    rows = json.loads(out[: out.rindex("]") + 1])
    assert code == 1 and time.monotonic() - start < 120
    assert [r["strategy"] for r in rows] == ["single", "ring_allreduce"]
    assert all("timed out after 3 s" in r["error"] for r in rows)
