"""Help a user reads: what lightning_par is, the strategy names one types, each strategy's own
options only, and the compare command's help as plain text with its defaults."""

import inspect
import re
import sys

import pytest

from lightning_par import cli
from lightning_par.cli_checks import our_strategy_names
from lightning_par.cli_help import own_options, plain, resolve_strategy
from lightning_par.compare import __main__ as compare_main

#: torch DDP's options, which no lightning_par strategy takes (it has no DDP wrapper)
DDP_ONLY = ("ddp_comm_hook", "static_graph", "find_unused_parameters", "gradient_as_bucket_view",
            "broadcast_buffers", "model_averaging_period", "parallel_devices")  # fmt: skip


@pytest.fixture(autouse=True)
def _command_line(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["lightning-par"])


def _help(capsys, *argv: str) -> str:
    try:
        cli.main(list(argv))
    except SystemExit as stop:
        assert stop.code in (0, None), capsys.readouterr()
    return capsys.readouterr().out


def test_top_level_help_says_what_lightning_par_is_and_names_the_strategies(capsys):
    text = " ".join(_help(capsys, "--help").split())
    assert "lightning_par: PyTorch Lightning strategies" in text
    for name in our_strategy_names():
        assert re.search(rf"\b{name}\b", text), name


def test_fit_help_lists_strategy_names_whole_and_no_class_paths(capsys):
    text = _help(capsys, "fit", "--help")
    start = text.index("\n  --trainer.strategy STRATEGY")
    block = text[start : text.index("\n  --", start + 10)]
    words = set(re.findall(r"\w+", block))
    for name in our_strategy_names():  # never broken across lines mid-word
        assert name in words, (name, block)
    assert "known subclasses" not in block and "lightning_par.strategies." not in block, block
    assert "``" not in block, block


@pytest.mark.parametrize("name", ["gpipe", "GPipeStrategy", "ring_allreduce", "parameter_server"])
def test_a_strategy_help_shows_only_its_own_options(capsys, name):
    text = _help(capsys, "fit", "--trainer.strategy.help", name)
    options = re.findall(r"--trainer\.strategy\.(\w+)", text)
    for ddp in DDP_ONLY:
        assert ddp not in options, (ddp, text)
    cls, _ = resolve_strategy(name)
    assert set(options) - {"OPTION"} == {p.name for p, _ in own_options(cls)}
    assert "trace" in options and "timeout" in options  # the options every plugin shares
    if name in ("gpipe", "GPipeStrategy"):  # exactly GPipe's own and ParStrategy's
        declared = set(inspect.signature(cls).parameters) - {"kwargs"}
        shared = {"trace", "trace_dir", "start_method", "process_group_backend", "timeout",
                  "dead_peer_timeout"}  # fmt: skip
        assert set(options) - {"OPTION"} == declared | shared, options
        assert {"chunks", "schedule", "balance", "checkpoint"} <= set(options)
        assert "micro-batches per batch" in text  # descriptions from the docstring
    if name == "ring_allreduce":
        assert "(default: 'ring')" in text  # the registered name's own defaults


def test_every_registered_strategy_has_a_help_without_ddp_options(capsys):
    for name in our_strategy_names():
        if name == "lightning_ddp":  # Lightning's DDP itself: its options do apply
            continue
        text = _help(capsys, "fit", f"--trainer.strategy.help={name}")
        assert text.startswith("usage: lightning-par fit --trainer.strategy="), (name, text)
        assert not set(re.findall(r"--trainer\.strategy\.(\w+)", text)) & set(DDP_ONLY), name


def test_a_lightning_strategy_name_gets_jsonargparse_help_of_its_class(capsys):
    text = _help(capsys, "fit", "--trainer.strategy.help", "ddp")
    assert "--trainer.strategy.find_unused_parameters" in text


def test_plain_drops_sphinx_markup():
    assert plain("see :func:`~a.b.c` and :mod:`x.y`, ``z``") == "see c and x.y, `z`"


def test_compare_help_is_plain_text_with_defaults(capsys):
    with pytest.raises(SystemExit):
        compare_main.parse(["--help"])
    text = capsys.readouterr().out
    assert "``" not in text and ":func:" not in text, text
    text = text[text.index("options:") :]
    for option, default in (("--steps", "20"), ("--model", "CifarCNN"), ("--devices", "2"),
                            ("--data", "cifar10-mini"), ("--timeout", "180")):  # fmt: skip
        line = re.search(rf"{option} \S+\s+(?:\n\s+)?(.*)", text)
        assert line and f"(default: {default})" in line[1], (option, text)
