"""A user's own script, run as ``python script.py``: as quiet as the CLI in every rank, full
training batches, async_sgd's progress per worker, and no temporary folder left behind."""

import os
import re
import sys
import textwrap
import warnings

import lightning.pytorch as pl
import pytest
import torch

from lightning_par.launch.processes import run_bounded
from lightning_par.quiet import quiet_from_environment, quiet_lightning

SCRIPT = textwrap.dedent(
    """
    import sys

    import lightning.pytorch as pl
    import lightning_par  # registers the strategy names, filters the known noise
    from lightning_par.data import CIFAR10DataModule
    from lightning_par.models import CifarCNN


    class FullBatches(pl.Callback):
        # every training batch must hold batch_size images, on every rank
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if len(batch[0]) != 32:
                raise AssertionError(f"a training batch of {len(batch[0])} images")


    if __name__ == "__main__":
        trainer = pl.Trainer(
            strategy=sys.argv[1], accelerator="cpu", devices=2, max_epochs=int(sys.argv[2]),
            callbacks=[FullBatches()], log_every_n_steps=1,
        )
        # 330 images, 33 held out: 297 = 9 x 32 + 9 training images
        data = CIFAR10DataModule(source="synthetic", synthetic_size=330, batch_size=32)
        trainer.fit(CifarCNN(width=8, num_blocks=1), datamodule=data)
    """
)

#: The messages quiet_lightning filters, and Lightning's advice about our own logs.
NOISE = ("tensorboardX", "litlogger", "litmodels", "LeafSpec", "sync_dist")


def _run_script(tmp_path, *args, **env):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    private_tmp = tmp_path / "tmp"
    private_tmp.mkdir()
    environ = {**os.environ, "TMPDIR": str(private_tmp), **env}
    environ["PYTHONPATH"] = os.pathsep.join([os.getcwd(), *sys.path])
    environ.pop("LIGHTNING_PAR_QUIET", None)
    environ.update(env)
    proc = run_bounded([sys.executable, str(script), *args], 240, cwd=tmp_path, env=environ)
    left = sorted(p.name for p in private_tmp.iterdir() if not p.name.startswith("torchinductor"))
    return proc, proc.stdout + proc.stderr, left


def test_async_sgd_script_is_quiet_shows_each_workers_batches_and_leaves_no_temp_folder(
    tmp_path,
):
    proc, text, left = _run_script(tmp_path, "async_sgd", "2")
    assert proc.returncode == 0, text[-4000:]
    for noise in NOISE:
        assert noise not in text, (noise, text[-4000:])
    # the start-up line names the registered strategy
    assert "lightning_par: async_sgd (1 server(s)) on 2 process(es)" in text
    # the bar counts this worker's batches with no total: "Epoch 0: ... 5/?", never "5/9"
    assert not re.search(r"Epoch \d+: .*\d+/9\b", text), text[-4000:]
    assert re.search(r"Epoch 1: .*\d+/\?", text), text[-4000:]
    # each epoch ends with one line per worker; together they trained the 9 batches
    for epoch in (0, 1):
        took = re.findall(
            rf"async_sgd epoch {epoch}: worker (\d) trained (\d+) of the epoch's 9 shared", text
        )
        assert sorted(w for w, _ in took) == ["0", "1"], text[-4000:]
        assert sum(int(n) for _, n in took) == 9, took
    assert left == [], left  # rank 0's weights came back through a folder now removed


def test_popen_ranks_rerun_the_import_and_are_quiet_too(tmp_path):
    proc, text, left = _run_script(tmp_path, "ring_allreduce", "1",
                                   LIGHTNING_PAR_START_METHOD="popen")  # fmt: skip
    assert proc.returncode == 0, text[-4000:]
    assert "(popen, gloo" in text, text[-4000:]
    for noise in NOISE:
        assert noise not in text, (noise, text[-4000:])
    assert left == [], left


def _ignored(pattern_part: str) -> bool:
    return any(f[0] == "ignore" and pattern_part in str(f[1]) for f in warnings.filters)


def test_lightning_par_quiet_0_keeps_every_message(monkeypatch):
    # the script test above shows that the import filters; this is the switch it reads
    with warnings.catch_warnings():
        warnings.resetwarnings()
        monkeypatch.setenv("LIGHTNING_PAR_QUIET", "0")
        assert quiet_from_environment() is False and not _ignored("tensorboardX")
        monkeypatch.delenv("LIGHTNING_PAR_QUIET")
        assert quiet_from_environment() is True and _ignored("tensorboardX")


def test_quiet_lightning_false_shows_the_messages_again():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_lightning()
        warnings.warn("Starting from v1.9.0, `tensorboardX` has been removed", stacklevel=1)
        quiet_lightning(False)
        warnings.warn("Starting from v1.9.0, `tensorboardX` has been removed", stacklevel=1)
        quiet_lightning()  # on again: the newest choice wins
        warnings.warn("Starting from v1.9.0, `tensorboardX` has been removed", stacklevel=1)
    assert len(caught) == 1


class SmallestBatch(pl.Callback):
    """The smallest training batch a rank saw (a module-level class: where fork is unsafe,
    a forkserver launch pickles the Trainer and its callbacks)."""

    def __init__(self):
        self.smallest = 10**9

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.smallest = min(self.smallest, len(batch[0]))

    def on_train_end(self, trainer, pl_module):  # travels back from the ranks
        trainer.callback_metrics["smallest_batch"] = torch.tensor(float(self.smallest))


@pytest.mark.parametrize("strategy", ["gpipe", "parameter_server"])
def test_training_batches_are_full_for_model_split_and_server_plugins(strategy, tmp_path):
    from lightning_par.data import CIFAR10DataModule
    from lightning_par.models import CifarCNN

    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=2, max_epochs=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, callbacks=[SmallestBatch()], default_root_dir=tmp_path,
    )  # fmt: skip
    data = CIFAR10DataModule(source="synthetic", synthetic_size=330, batch_size=32)
    trainer.fit(CifarCNN(width=8, num_blocks=1), datamodule=data)
    assert float(trainer.callback_metrics["smallest_batch"]) == 32


def test_async_sgd_without_a_progress_bar_prints_no_epoch_lines(tmp_path, capfd):
    # benchmarks and the check turn the bar off: their output stays the report
    import lightning.pytorch as pl

    from lightning_par.data import CIFAR10DataModule
    from lightning_par.models import CifarCNN

    trainer = pl.Trainer(
        strategy="async_sgd", accelerator="cpu", devices=2, max_epochs=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, default_root_dir=tmp_path,
    )  # fmt: skip
    data = CIFAR10DataModule(source="synthetic", synthetic_size=330, batch_size=32)
    trainer.fit(CifarCNN(width=8, num_blocks=1), datamodule=data)
    out, err = capfd.readouterr()
    assert "async_sgd epoch" not in out + err
