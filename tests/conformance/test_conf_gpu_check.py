"""``make gpu-check``'s driver (:mod:`lightning_par.gpucheck`): refused with a clear message
and no traceback where there is no CUDA device; on CPU the same driver trains the rows and
prints one table with each row's ratio to single-device Lightning."""

from __future__ import annotations

from lightning_par import gpucheck


def test_without_cuda_the_gpu_check_is_refused_with_the_reason(monkeypatch, capsys):
    monkeypatch.setattr(gpucheck, "cuda_devices", lambda: 0)
    assert gpucheck.main(["--accelerator", "gpu"]) == gpucheck.REFUSED
    err = capsys.readouterr().err
    assert err.startswith("no CUDA device: ") and "Traceback" not in err


def test_the_cpu_path_prints_one_table_against_single_device_lightning(capsys):
    code = gpucheck.main(["--accelerator", "cpu", "--strategies", "ring_allreduce",
                          "zero:stage=1", "--steps", "4", "--timeout", "240"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    lines = [ln for ln in out.splitlines() if ln.startswith("|")]
    assert lines[0].startswith("| strategy |") and "x single device" in lines[0]
    rows = {ln.split("|")[1].strip(): [c.strip() for c in ln.split("|")[1:-1]] for ln in lines[2:]}
    assert set(rows) == {"single", "ring_allreduce", "zero:stage=1"}, out
    assert rows["zero:stage=1"][4] == "ok" and rows["zero:stage=1"][3] == "2", out
    assert rows["single"][6] == "1.00" and rows["single"][3] == "1", out
    ring = rows["ring_allreduce"]
    assert ring[4] == "ok" and ring[3] == "2" and float(ring[6]) > 0, out
    shown = float(ring[5]) / float(rows["single"][5])  # (images/s are printed to 0.1)
    assert abs(float(ring[6]) - shown) <= 0.02 * shown + 0.01, out


def test_by_default_the_gpu_check_runs_zeros_other_stages_too(monkeypatch, capsys):
    from lightning_par import check

    asked = []
    monkeypatch.setattr(check, "check_group", lambda rows, *a: asked.extend(rows) or [])
    assert gpucheck.main(["--accelerator", "cpu", "--no-tests"]) == 0
    names = [row[0] for row in asked]
    assert {"zero", "zero:stage=1", "zero:stage=2"} <= set(names), names


def test_a_row_with_fewer_devices_than_its_strategy_needs_is_not_run_and_not_failed(
    monkeypatch, capsys
):
    # a one-GPU machine: hybrid needs dp x mp = 2 processes with its default options
    from lightning_par import check

    one_device = [("single", "CifarCNN", "cpu", 1), ("hybrid", "CifarCNN", "cpu", 1)]
    monkeypatch.setattr(check, "plan", lambda *args: one_device)
    code = gpucheck.main(["--accelerator", "cpu", "--steps", "2", "--timeout", "120"])
    out = capsys.readouterr().out
    assert code == 0, out
    hybrid = next(ln for ln in out.splitlines() if ln.startswith("| hybrid |"))
    assert "| not run |" in hybrid, out
    assert "NOT RUN hybrid cpu: hybrid needs 2 processes" in out, out


def test_the_hybrid_refusal_on_one_process_suggests_one_grid_once():
    import pytest

    from lightning_par.hybrid import make_grid

    with pytest.raises(ValueError, match="mp=2 does not divide the 1 processes") as err:
        make_grid(1)
    assert str(err.value).count("dp=1, mp=1") == 1


def test_the_check_table_prints_a_row_that_was_not_run(monkeypatch, capsys):
    from lightning_par import check

    monkeypatch.setattr(check, "plan", lambda *args: [("hybrid", "CifarRNN", "cpu", 1)])
    monkeypatch.setattr(check, "quiet_report", lambda: None)  # (it quiets Lightning for good)
    assert check.main(["--accelerators", "cpu", "--models", "CifarRNN"]) == 0
    out = capsys.readouterr().out
    assert "| hybrid | CifarRNN | cpu | 1 | not run | - | - |" in out, out
    assert "NOT RUN hybrid CifarRNN cpu: hybrid needs 2 processes" in out, out
