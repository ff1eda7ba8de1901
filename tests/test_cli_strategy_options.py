"""Every strategy's options from the command line and a YAML config (jsonargparse reads the
constructors), and a wrong option or value refused in one usage line naming it."""

import importlib
import subprocess
import sys
import time

import pytest
import yaml

from lightning_par.cli import main
from lightning_par.cli_help import cli_option_names
from lightning_par.strategies import registry

TINY = ["fit", "--model=CifarCNN", "--model.width=8", "--model.num_blocks=1",
        "--data.source=synthetic", "--data.synthetic_size=64", "--data.batch_size=16",
        "--trainer.accelerator=cpu", "--trainer.devices=2", "--trainer.max_steps=2",
        "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false", "--test_after_fit=false"]  # fmt: skip
#: ParStrategy's options, which every plugin takes (parameter servers: always gloo)
SHARED = {"trace", "trace_dir", "start_method", "timeout", "dead_peer_timeout"}
#: torch DDP's keywords, which only lightning_ddp takes
DDP_ONLY = {"ddp_comm_hook", "static_graph", "find_unused_parameters", "broadcast_buffers",
            "gradient_as_bucket_view", "batched_grad_copy", "device_mesh", "parallel_devices",
            "accelerator", "precision_plugin"}  # fmt: skip
#: (class, options typed, what the printed init_args must hold)
CASES = [
    (registry.AllReduceStrategy, {"algorithm": "tree", "bucket_cap_mb": "2"},
     {"algorithm": "tree", "bucket_cap_mb": 2.0}),
    (registry.GPipeStrategy, {"chunks": "2", "schedule": "1f1b"},
     {"chunks": 2, "schedule": "1f1b"}),
    (registry.LayerwiseStrategy, {"balance_by": "time"}, {"balance_by": "time"}),
    (registry.TensorParallelStrategy, {"module_attr": "net"}, {"module_attr": "net"}),
    (registry.HybridStrategy, {"dp": "1", "mp": "2", "chunks": "2"},
     {"dp": 1, "mp": 2, "chunks": 2}),
    (registry.ParameterServerStrategy, {"num_servers": "2", "fault_tolerant": "true"},
     {"num_servers": 2, "fault_tolerant": True}),
    (registry.AsyncSGDStrategy, {"staleness": "1", "momentum": "0.5"},
     {"staleness": 1, "momentum": 0.5}),
    (registry.LocalSGDStrategy, {"period": "2", "algorithm": "tree"},
     {"period": 2, "algorithm": "tree"}),
    (registry.ZeroStrategy, {"stage": "2", "bucket_cap_mb": "1"},
     {"stage": 2, "bucket_cap_mb": 1.0}),
    (registry.LightningDDPStrategy, {"find_unused_parameters": "true"},
     {"find_unused_parameters": True}),
]  # fmt: skip


@pytest.fixture(autouse=True)
def _plain_argv(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["lightning-par"])


def _printed(capsys, *argv: str) -> dict:
    with pytest.raises(SystemExit) as done:
        main([*TINY, *argv, "--print_config"])
    assert done.value.code in (0, None), capsys.readouterr().err
    return yaml.safe_load(capsys.readouterr().out)


def test_every_registered_class_is_covered():
    assert {cls for cls, _, _ in CASES} == {spec.cls for spec in registry.strategy_specs()}


@pytest.mark.parametrize("cls, typed, expected", CASES, ids=[c.__name__ for c, _, _ in CASES])
def test_a_strategy_class_takes_its_options_and_prints_a_config_that_reads_back(
    cls, typed, expected, tmp_path, capsys
):
    options = [f"--trainer.strategy.{k}={v}" for k, v in typed.items()]
    config = _printed(capsys, f"--trainer.strategy={cls.__name__}", *options)
    strategy = config["trainer"]["strategy"]
    module, _, name = strategy["class_path"].rpartition(".")
    assert getattr(importlib.import_module(module), name) is cls, strategy
    init_args = strategy["init_args"]
    assert expected.items() <= init_args.items(), init_args
    assert set(init_args) == set(cli_option_names(cls))  # exactly the class's options
    assert SHARED <= set(init_args)
    if cls is not registry.LightningDDPStrategy:
        assert not set(init_args) & DDP_ONLY, init_args
    cls(**init_args)  # the printed values build the strategy
    path = tmp_path / "printed.yaml"
    path.write_text(yaml.safe_dump(config))
    assert _printed(capsys, f"--config={path}")["trainer"]["strategy"] == strategy


def test_a_registered_name_with_options_is_its_class_with_its_registered_options(capsys):
    strategy = _printed(capsys, "--trainer.strategy=ring_allreduce",
                        "--trainer.strategy.bucket_cap_mb=0.5")["trainer"]["strategy"]  # fmt: skip
    assert strategy["class_path"].endswith(".AllReduceStrategy")
    assert strategy["init_args"]["algorithm"] == "ring"
    assert strategy["init_args"]["bucket_cap_mb"] == 0.5
    strategy = _printed(capsys, "--trainer.strategy", "local_sgd",
                        "--trainer.strategy.period=8")["trainer"]["strategy"]  # fmt: skip
    assert strategy["init_args"]["period"] == 8 and strategy["init_args"]["algorithm"] == "ring"
    assert _printed(capsys, "--trainer.strategy=gpipe")["trainer"]["strategy"] == "gpipe"
    strategy = _printed(capsys, "--trainer.strategy=zero",
                        "--trainer.strategy.stage=2")["trainer"]["strategy"]  # fmt: skip
    assert strategy["class_path"].endswith(".ZeroStrategy")
    assert strategy["init_args"]["stage"] == 2


def test_a_yaml_config_trains_zero_at_the_stage_it_names(tmp_path):
    config = tmp_path / "zero.yaml"
    config.write_text(
        "trainer:\n  strategy:\n    class_path: lightning_par.strategies.ZeroStrategy\n"
        "    init_args:\n      stage: 1\n"
    )
    out = subprocess.run(
        [sys.executable, "-m", "lightning_par", *TINY, f"--config={config}",
         f"--trainer.default_root_dir={tmp_path}", "--print_config"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert yaml.safe_load(out.stdout)["trainer"]["strategy"]["init_args"]["stage"] == 1
    out = subprocess.run(
        [sys.executable, "-m", "lightning_par", *TINY, f"--config={config}",
         f"--trainer.default_root_dir={tmp_path}"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert "lightning_par summary: strategy=zero " in out.stdout, out.stdout[-2000:]
    assert "processes=2" in out.stdout


#: (options typed, what the one line must say)
BAD = [
    (["--trainer.strategy=GPipeStrategy", "--trainer.strategy.chunks=0"],
     "--trainer.strategy.chunks=0: GPipeStrategy: chunks (micro-batches per batch) must be"),
    (["--trainer.strategy=GPipeStrategy", "--trainer.strategy.chunkz=2"],
     "--trainer.strategy.chunkz is not an option of GPipeStrategy. Did you mean "
     "--trainer.strategy.chunks?"),
    (["--trainer.strategy=GPipeStrategy", "--trainer.strategy.schedule=1fb1"],
     "--trainer.strategy.schedule=1fb1: GPipeStrategy: schedule='1fb1': choose one of"),
    (["--trainer.strategy=gpipe", "--trainer.strategy.virtual_stage=2"],
     "Did you mean --trainer.strategy.virtual_stages?"),
    (["--trainer.strategy=zero", "--trainer.strategy.stage=4"],
     "--trainer.strategy.stage=4: ZeroStrategy: zero: stage must be 1 (optimizer state sharded)"),
    (["--trainer.strategy=AllReduceStrategy", "--trainer.strategy.algorithm=tre"],
     "--trainer.strategy.algorithm=tre: AllReduceStrategy: unknown allreduce algorithm"),
    (["--trainer.strategy=HybridStrategy", "--trainer.strategy.mp_kind=tensor_parallel",
      "--trainer.strategy.chunks=2"],
     "--trainer.strategy.chunks=2: HybridStrategy: HybridStrategy got unknown option(s) "
     "['chunks'] for mp_kind='tensor_parallel'"),
]  # fmt: skip


@pytest.mark.parametrize("typed, expected", BAD, ids=[b[0][-1] for b in BAD])
def test_a_wrong_option_or_value_is_one_usage_line_naming_it(typed, expected, tmp_path, capsys):
    start = time.monotonic()
    with pytest.raises(SystemExit) as exit_info:
        main([*TINY, f"--trainer.default_root_dir={tmp_path}", *typed])
    assert exit_info.value.code == 2
    out, err = capsys.readouterr()
    assert err.startswith("lightning-par: error: "), err
    assert len(err.strip().splitlines()) == 1, err
    assert expected in err, err
    assert time.monotonic() - start < 30 and not list(tmp_path.iterdir())  # no rank, no logs


def test_a_misspelt_option_in_a_yaml_config_is_one_line_too(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text(
        "trainer:\n  strategy:\n    class_path: lightning_par.strategies.GPipeStrategy\n"
        "    init_args:\n      chunkz: 2\n"
    )
    out = subprocess.run(
        [sys.executable, "-m", "lightning_par", *TINY, f"--config={config}"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2
    assert out.stderr.startswith(
        "python -m lightning_par: error: --trainer.strategy.chunkz is not an option of "
        "GPipeStrategy. Did you mean --trainer.strategy.chunks?"
    ), out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr
