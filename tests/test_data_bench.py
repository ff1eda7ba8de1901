"""``python -m lightning_par.bench data``: the plain loop makes exactly the data module's
batches, the profiler charges each second to the innermost action, and a tiny CPU run
reports every contender and every bucket."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from lightning_par.bench import _step_profile, data
from lightning_par.bench._data_contenders import loop_batches
from lightning_par.bench._step_profile import BUCKETS, SelfTimeProfiler, bucket_of
from lightning_par.data import CIFAR10DataModule


def test_the_plain_loop_crops_and_flips_as_the_data_module_does():
    module = CIFAR10DataModule(source="synthetic", synthetic_size=96, val_size=0, seed=3,
                               batch_size=16, on_device=True)  # fmt: skip
    module.setup("fit")
    ours = module.train_dataloader()  # (no trainer: made on the CPU)
    images, labels = ours.images, ours.labels
    expected = [*ours, *ours]  # two epochs: the order and the crops change with the epoch
    loop = list(itertools.islice(loop_batches(images, labels, 16, seed=3), len(expected)))
    assert len(expected) == 12
    for (x, y), (lx, ly) in zip(expected, loop):
        assert torch.equal(x, lx) and torch.equal(y, ly)
    other = next(loop_batches(images, labels, 16, seed=4))[0]  # a seed draws other crops
    assert not torch.equal(other, expected[0][0])


def test_self_time_is_charged_to_the_innermost_action_within_the_window(monkeypatch):
    clock = iter([0.0, 1.0, 2.0, 3.0, 6.0, 7.0, 8.0, 12.0])
    monkeypatch.setattr(_step_profile.time, "perf_counter", lambda: next(clock))
    p = SelfTimeProfiler()
    p.start("run_training_batch")  # 0: opened before the window
    p.begin_window()  # 1: it counts from here
    p.start("[Strategy]SingleDeviceStrategy.backward")  # 2
    p.start("[bench] forward")  # 3
    p.stop("[bench] forward")  # 6: 3 s
    p.stop("[Strategy]SingleDeviceStrategy.backward")  # 7: 5 s, 3 of them its child's
    p.start("[Callback]Clock.on_train_batch_end")  # 8, still open at the window's end
    p.end_window()  # 12
    assert p.window_s == 11.0
    got = p.buckets_ms(steps=1)
    assert got["forward"] == 3e3 and got["backward"] == 2e3 and got["callbacks"] == 4e3
    assert got["loop"] == 2e3  # run_training_batch's own seconds, 1 to 2 and 7 to 8
    assert sum(got.values()) == pytest.approx(1e3 * p.window_s)


def test_actions_fall_in_their_buckets():
    assert bucket_of("[_TrainingEpochLoop].train_dataloader_next") == "data"
    assert bucket_of("[Strategy]SingleDeviceStrategy.batch_to_device") == "data"
    assert bucket_of("[Strategy]SingleDeviceStrategy.training_step") == "strategy_hooks"
    assert bucket_of("[LightningModule]CifarCNN.on_before_backward") == "module_hooks"
    assert bucket_of("[LightningModule]CifarCNN.optimizer_zero_grad") == "optimizer"
    assert bucket_of("[bench] metrics_logging") == "metrics_logging"
    assert bucket_of("run_training_epoch") == "loop"


def test_a_tiny_cpu_run_reports_every_contender_and_every_bucket(capsys):
    code = data.main(["--device", "cpu", "--steps", "4", "--warmup", "2", "--rounds", "1",
                      "--batch-size", "16", "--train-images", "64", "--width", "4",
                      "--num-blocks", "1", "--hidden-size", "8", "--num-layers", "1",
                      "--json"])  # fmt: skip
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    assert result["environment"]["torch"] == torch.__version__
    rows = {(r["model"], r["runner"]): r for r in result["rows"]}
    assert set(rows) == {(m, c) for m in ("CifarCNN", "CifarRNN") for c in data.CONTENDERS}
    for (_, runner), row in rows.items():
        assert row["images_per_s"] > 0 and row["steps_timed"] == 2
        assert row["images_per_s"] == pytest.approx(16 / (row["step_ms"] / 1e3))
        if runner == data.PEER:
            assert row["speed_vs_torch_loop"] == 1.0
    for profile in result["profiles"]:
        buckets = {b["bucket"]: b for b in profile["buckets"]}
        assert list(buckets) == list(BUCKETS)
        for b in ("data", "forward", "backward", "optimizer"):
            assert buckets[b]["torch_loop_ms"] > 0 and buckets[b]["lightning_ms"] > 0, b
        # our metric and self.log happen in Lightning's step only
        assert buckets["metrics_logging"]["torch_loop_ms"] == 0
        assert buckets["metrics_logging"]["lightning_ms"] > 0
        for name in ("torch_loop", "lightning"):
            total = sum(b[f"{name}_ms"] for b in profile["buckets"])
            assert profile["profiled_step_ms"][name] == pytest.approx(total)
        assert profile["lightning_top_actions"][0]["self_ms"] > 0


def test_cuda_asked_for_without_a_gpu_is_refused_with_the_reason(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert data.main(["--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("bench data: no CUDA device") and "Traceback" not in err
