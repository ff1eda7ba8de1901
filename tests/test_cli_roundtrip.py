"""The command reads back what it prints and names options as the user types them."""

import sys

import pytest
import yaml

from lightning_par.cli import _as_typed, main

TINY = ["--model.width=8", "--model.num_blocks=1", "--data.source=synthetic",
        "--data.synthetic_size=128", "--trainer.accelerator=cpu", "--trainer.devices=2",
        "--trainer.strategy=ring_allreduce", "--trainer.max_steps=1",
        "--trainer.limit_val_batches=0",
        "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
        "--test_after_fit=false"]  # fmt: skip


@pytest.fixture(autouse=True)
def _plain_argv(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["lightning-par"])


def test_print_config_runs_back_with_a_model_and_devices_as_a_number(tmp_path, capsys):
    with pytest.raises(SystemExit) as printed:
        main(["fit", *TINY, f"--trainer.default_root_dir={tmp_path}", "--print_config"])
    assert printed.value.code in (0, None)
    text = capsys.readouterr().out
    config = yaml.safe_load(text)
    assert config["model"]["class_path"] == "lightning_par.models.CifarCNN", text
    assert config["model"]["init_args"]["width"] == 8
    assert config["trainer"]["devices"] == 2 and "devices: '2'" not in text
    path = tmp_path / "printed.yaml"
    path.write_text(text)
    main(["fit", f"--config={path}"])
    # the summary names the registered strategy, not the class (AllReduceStrategy)
    assert "lightning_par summary: strategy=ring_allreduce " in capsys.readouterr().out


def test_errors_name_options_as_typed():
    assert _as_typed("the following arguments are required: fit.model") == (
        "the following arguments are required: --model"
    )
    assert _as_typed('Parser key "trainer.max_epochs":\n  Expected') == (
        "--trainer.max_epochs:\n  Expected"
    )
    assert _as_typed('Parser key "width":') == 'Parser key "width":'  # nested: left alone


def _usage_error(capsys, *args) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(list(args))
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def test_a_bad_value_names_the_option_and_a_missing_subcommand_is_pointed_out(capsys):
    err = _usage_error(capsys, "fit", "--trainer.max_epochs=x")
    assert err.startswith("lightning-par: error: --trainer.max_epochs:"), err
    err = _usage_error(capsys, "--model=CifarCNN")
    assert "The subcommand is missing" in err, err
    assert "`lightning-par fit --model=CifarCNN`" in err
