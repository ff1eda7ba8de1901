"""The README's first script works from the folder that holds the checkout.

A clone named ``lightning_par`` has no ``__init__.py`` at its root, so a script run from the
folder above it finds that folder first on ``sys.path`` (the script's own folder) as a
namespace-package portion. Python's path finder prefers a regular package anywhere on
``sys.path`` to a namespace portion, but setuptools' default editable install is an import
hook that runs only after the path finder has answered with the empty namespace package:
nothing registers, and Lightning rejects ``strategy="ring_allreduce"`` as an invalid name.
``make setup`` therefore installs with ``editable_mode=compat`` (a ``.pth`` line naming
the checkout, a plain ``sys.path`` entry), as setuptools' documentation on editable installs
describes (https://setuptools.pypa.io/en/latest/userguide/development_mode.html).
"""

import re
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from lightning_par.launch.processes import run_bounded

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def _first_snippet() -> str:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)[0]


def test_the_editable_install_is_a_path_entry_not_an_import_hook():
    dist = metadata.distribution("lightning_par")
    pth = [f for f in dist.files or [] if f.name.endswith(".pth")]
    assert pth, "lightning_par is not installed in editable mode: run `make setup`"
    lines = Path(dist.locate_file(pth[0])).read_text().split()
    assert lines == [str(ROOT)], (
        f"{pth[0]} holds {lines}, not the checkout's path: an import hook loses to a folder "
        "named lightning_par beside a script; install with "
        "`pip install -e . --config-settings editable_mode=compat` (as `make setup` does)"
    )


def test_the_readme_snippet_trains_from_the_folder_that_holds_the_checkout(tmp_path):
    # a copy of the checkout, named as a clone of the repository is, with the script beside it
    files = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    checkout = tmp_path / "lightning_par"
    for name in files:
        if (ROOT / name).is_file():
            (checkout / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, checkout / name)
    assert (checkout / "lightning_par" / "__init__.py").is_file()
    assert not (checkout / "__init__.py").exists()

    snippet = _first_snippet()
    short = snippet.replace(
        "max_epochs=5", "max_epochs=1, limit_train_batches=3, limit_val_batches=1"
    )
    assert short != snippet, "the README's first snippet no longer says max_epochs=5"
    script = tmp_path / "first.py"
    script.write_text(
        short
        + "\nprint('package', lightning_par.__file__)"
        + "\nprint('trained', trainer.strategy.strategy_name, trainer.state.status.value,"
        + " sorted(trainer.callback_metrics))\n"
    )
    proc = run_bounded([sys.executable, script.name], 240, cwd=tmp_path)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-4000:]
    assert f"package {ROOT / 'lightning_par' / '__init__.py'}" in text, text[-4000:]
    # the ranks' logged metrics came back to the script: it trained and validated
    assert "trained ring_allreduce finished" in text, text[-4000:]
    assert "'train_loss'" in text and "'val_acc'" in text, text[-4000:]
