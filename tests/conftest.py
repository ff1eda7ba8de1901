import logging
import os
import shutil
import signal
import tempfile
import warnings
from pathlib import Path

import pytest

# Multi-process tests fail fast: a silent peer times out after 20 s, not 60.
os.environ.setdefault("LIGHTNING_PAR_TIMEOUT", "20")
logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
logging.getLogger("lightning.fabric").setLevel(logging.ERROR)
warnings.filterwarnings("ignore", ".*does not have many workers.*")


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist (``make test`` runs two workers), a short base for every test's
    temporary folder. Tests give the scripts they start a private ``TMPDIR`` inside their
    ``tmp_path``, where multiprocessing's forkserver makes its socket; with xdist's longer
    default (``/tmp/pytest-of-USER/pytest-N/popen-gw0/...``) that socket's path passes the
    108 bytes a Unix socket's path may have ("AF_UNIX path too long"). Removed at the end."""
    if "LIGHTNING_PAR_CACHE" not in os.environ:  # the ring's calibrations: none of the user's
        cache = tempfile.mkdtemp(prefix="lpt-cache-")
        os.environ["LIGHTNING_PAR_CACHE"] = cache
        config.add_cleanup(lambda: shutil.rmtree(cache, ignore_errors=True))
    distributed = config.getoption("numprocesses", None) and not hasattr(config, "workerinput")
    if distributed and config.option.basetemp is None:
        config.option.basetemp = tempfile.mkdtemp(prefix="lpt-")
        config.add_cleanup(lambda: shutil.rmtree(config.option.basetemp, ignore_errors=True))


@pytest.fixture(scope="session")
def mini_dir() -> Path:
    """The real CIFAR-10 subset beside the project (CI has ../shared beside the clone)."""
    from lightning_par.data import find_cifar10_mini

    path = find_cifar10_mini()
    assert path is not None, (
        "cifar10-mini not found: set LIGHTNING_PAR_CIFAR10_MINI or put shared/ beside the repo"
    )
    return path


@pytest.fixture(autouse=True)
def _run_in_tmp_dir(tmp_path, monkeypatch):
    """Each test runs in its own temporary folder, so Trainer logs and checkpoints written
    to the working directory never land in the repository."""
    monkeypatch.chdir(tmp_path)


@pytest.fixture(autouse=True)
def _signal_handlers_restored():
    """Each test leaves SIGINT and SIGTERM as it found them. Lightning ignores SIGINT for
    good once a Trainer call is interrupted (``_call_and_handle_interrupt``, before its
    ``sys.exit``): a test that interrupts a fit in this process and catches the exit would
    leave every later child started with SIGINT ignored, deaf to Ctrl-C
    (tests/test_interrupts.py saw exactly that in a full run)."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    yield
    for signum, handler in saved.items():
        if signal.getsignal(signum) is not handler and handler is not None:
            signal.signal(signum, handler)


@pytest.fixture(autouse=True)
def _global_seed_restored():
    """Each test leaves Lightning's seed variables as it found them. ``seed_everything(7)``
    sets ``PL_GLOBAL_SEED`` for the whole process, Lightning's ``DistributedSampler`` shuffles
    with it, and every later child inherits it: the notebooks' kernels that nbval starts after
    the tests drew another order than the one their reference computed (a full run of
    course/09 failed so, alone it passed)."""
    names = ("PL_GLOBAL_SEED", "PL_SEED_WORKERS")
    saved = {name: os.environ.get(name) for name in names}
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
