"""Lines a user reads during a fit: the estimate and layerwise's memory table on lines of
their own above the progress bar, sizes in KiB/MiB, no column of zero FLOPs in the model
summary, and lightning_par's warnings without a source path."""

import os
import re
import subprocess
import sys
import warnings

from lightning_par.launch.policy import warn_if_oversubscribed
from lightning_par.output import PACKAGE, format_bytes

ARGS = [
    "fit", "--model=CifarCNN", "--model.width=8", "--model.num_blocks=1",
    "--data.source=synthetic", "--data.batch_size=32", "--data.synthetic_size=1024",
    "--trainer.accelerator=cpu", "--trainer.devices=2", "--trainer.strategy=layerwise",
    "--trainer.max_epochs=1", "--trainer.limit_val_batches=1", "--test_after_fit=false",
    "--trainer.enable_progress_bar=true", "--trainer.logger=false",
    "--trainer.enable_checkpointing=false",
]  # fmt: skip


def test_sizes_read_in_binary_units():
    assert [format_bytes(n) for n in (0, 512, 1536, 11_131_136, 120 * 2**20, 3 * 2**30)] == [
        "0 B", "512 B", "1.50 KiB", "10.6 MiB", "120 MiB", "3.00 GiB",
    ]  # fmt: skip


def _before_on_its_line(text: str, marker: str) -> str:
    """What the terminal shows before ``marker`` on its line (after the last ``\\r``)."""
    line = next(ln for ln in text.split("\n") if marker in ln)
    return line[: line.index(marker)].split("\r")[-1]


def test_estimate_and_memory_table_sit_above_the_bar_and_the_summary_has_no_zero_flops(
    tmp_path,
):
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_par", *ARGS, f"--trainer.default_root_dir={tmp_path}"],
        capture_output=True, text=True, timeout=240, cwd=tmp_path,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert re.search(r"Epoch 0: +\d+%\|", proc.stdout), "no progress bar on stdout"
    for marker in ("lightning_par estimate:", "layerwise memory per stage:"):
        assert marker in proc.stdout, (marker, out[-4000:])
        assert _before_on_its_line(proc.stdout, marker).strip() == "", (
            marker,
            _before_on_its_line(proc.stdout, marker),
        )
    table = re.findall(r"stage \d: params (.*)", proc.stdout)
    assert len(table) == 2, out[-4000:]
    for row in table:
        assert " B," not in row or re.search(r"\d+ B,", row), row
        assert not re.search(r"\d{1,3}(,\d{3})+ B", row), row  # no raw byte counts
        assert re.search(r"\d (KiB|MiB)", row), row
    assert "Total params" in out, out[-4000:]
    assert "FLOPs" not in out and "Total Flops" not in out, out[-4000:]


def test_lightning_par_warnings_show_no_source_path(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn_if_oversubscribed("cpu", 4)
    (w,) = caught
    # as the launcher calls it (stacklevel=2 names the caller, .../strategies/_launchers.py)
    launcher = str(PACKAGE / "strategies" / "_launchers.py")
    shown = warnings.formatwarning(w.message, w.category, launcher, 133)
    assert shown.startswith("UserWarning: 4 processes on 2 CPU cores"), shown
    assert ".py:" not in shown, shown
    # everyone else's warnings keep their usual form
    other = warnings.formatwarning("elsewhere", UserWarning, "/x/y/other.py", 3)
    assert "/x/y/other.py:3" in other
