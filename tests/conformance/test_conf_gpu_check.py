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
                          "--steps", "4", "--timeout", "240"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    lines = [ln for ln in out.splitlines() if ln.startswith("|")]
    assert lines[0].startswith("| strategy |") and "x single device" in lines[0]
    rows = {ln.split("|")[1].strip(): [c.strip() for c in ln.split("|")[1:-1]] for ln in lines[2:]}
    assert set(rows) == {"single", "ring_allreduce"}, out
    assert rows["single"][6] == "1.00" and rows["single"][3] == "1", out
    ring = rows["ring_allreduce"]
    assert ring[4] == "ok" and ring[3] == "2" and float(ring[6]) > 0, out
    shown = float(ring[5]) / float(rows["single"][5])  # (images/s are printed to 0.1)
    assert abs(float(ring[6]) - shown) <= 0.02 * shown + 0.01, out
