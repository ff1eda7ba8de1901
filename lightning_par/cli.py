"""The ``lightning-par`` command: LightningCLI over the example models and CIFAR-10.

Every Trainer flag and every registered strategy name works from the command line and
from a YAML config, e.g.::

    lightning-par fit --model=CifarCNN --data.source=cifar10-mini \\
        --trainer.devices=2 --trainer.strategy=ring_allreduce --trainer.max_epochs=3

After ``fit`` the model is tested (``--test_after_fit=false`` to skip) and one summary
line reports the strategy, the data used, throughput and accuracy. A value that cannot
work (unknown strategy, source, model, accelerator; 0 devices; negative counts) ends the
command at once with a short usage error and exit code 2, before any process starts.
"""

from __future__ import annotations

import re
import sys
from typing import Union

from jsonargparse import ArgumentError
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import ModelSummary
from lightning.pytorch.cli import LightningCLI

import lightning_par  # noqa: F401  (registers the strategy names)
from lightning_par import _compat
from lightning_par.cli_checks import UsageError, check_argv, check_config
from lightning_par.cli_help import (
    description,
    requested_strategy_help,
    strategy_help,
    strategy_names_help,
    with_class_path,
)
from lightning_par.cli_strategy import (
    constructor_error,
    unknown_option_error,
    with_registered_class,
)
from lightning_par.components.checkpoint_check import CheckpointError, check_checkpoint
from lightning_par.data import CIFAR10DataModule, DataNotFoundError
from lightning_par.models import CifarCNN, CifarRNN, ImageClassifier  # noqa: F401
from lightning_par.quiet import quiet_lightning
from lightning_par.summary import (
    FitTimeEstimate,
    ThroughputMonitor,
    WholeModelSummary,
    summary_line,
)

SUBCOMMANDS = ("fit", "validate", "test", "predict")
#: The options a subcommand takes at its top level (``--model``, ``--trainer.<flag>``, ...).
TOP_LEVEL_KEYS = ("trainer", "model", "data", "optimizer", "lr_scheduler", "ckpt_path",
                  "seed_everything", "test_after_fit", "weights_only")  # fmt: skip
#: What ``--model`` is when not given, so that ``--print_config`` writes a config that runs.
DEFAULT_MODEL = {"class_path": "lightning_par.models.CifarCNN"}


class LightningParCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        parser.add_argument(
            "--test_after_fit", type=bool, default=True, help="Test the model after fit."
        )
        parser.set_defaults({"model": DEFAULT_MODEL})
        _devices_as_numbers(parser)
        _strategy_names_in_help(parser)

    def parse_arguments(self, parser, args) -> None:
        check_argv(sys.argv[1:] if args is None else [str(a) for a in args])
        super().parse_arguments(parser, args)
        subcommand = self.config.get("subcommand")
        if subcommand:  # values from the command line and config files alike
            check_config(self.config[subcommand])
            # before LightningCLI reads the checkpoint's hyper-parameters (torch's raw errors)
            check_checkpoint(self.config[subcommand].get("ckpt_path"))

    def instantiate_classes(self) -> None:
        # Constructors that reject a value (ours, or Trainer's) do so before any process
        # starts: report the message, not the traceback.
        try:
            super().instantiate_classes()
        except (ValueError, MisconfigurationException) as err:
            strategy = self.config[self.config.subcommand].trainer.strategy
            raise UsageError(constructor_error(strategy) or str(err)) from None

    def after_instantiate_classes(self) -> None:
        # Lightning's default model summary, taken before a strategy can split the model.
        callbacks = self.trainer.callbacks
        for i, callback in enumerate(callbacks):
            if type(callback) is ModelSummary:
                depth, options = _compat.model_summary_options(callback)
                callbacks[i] = WholeModelSummary(depth, **options)

    def _data_before_launch(self) -> None:
        # Find (or download) and load the data here, in the parent, so a missing data set
        # is one clear error before any process starts; forked ranks inherit the loaded
        # tensors, and ranks that import the script afresh load them again.
        if isinstance(self.datamodule, CIFAR10DataModule):
            self.datamodule.prepare_data()
            self.datamodule.setup("fit")

    before_fit = before_validate = before_test = before_predict = _data_before_launch

    def after_fit(self) -> None:
        if self.config[self.subcommand].get("test_after_fit", True):
            self.trainer.test(self.model, datamodule=self.datamodule, verbose=False)
        if self.trainer.global_rank == 0:
            self._print_summary()

    def after_test(self) -> None:
        if self.trainer.global_rank == 0:
            self._print_summary()

    def _print_summary(self) -> None:
        # The data was set up here before launching, so its source is known in this process.
        print(summary_line(self.trainer, self.datamodule), flush=True)


def main(args: list[str] | None = None, prog: str = "lightning-par") -> None:
    """Run the command; ``prog`` is the name usage and error messages show."""
    quiet_lightning()
    argv = sys.argv[1:] if args is None else [str(a) for a in args]
    asked = requested_strategy_help(argv)
    if asked:
        text = strategy_help(asked, prog)
        if text:  # one of ours: only the options it declares, not Lightning's DDP plumbing
            print(text, end="")
            return
        argv = with_class_path(argv, asked)  # Lightning's: jsonargparse's help of the class
    argv = with_registered_class(argv)  # gpipe + options: GPipeStrategy + options
    if args is None:
        sys.argv[1:] = argv
    else:
        args = argv
    try:
        _run_cli(args, prog)
    except DataNotFoundError as err:
        # The message says what is missing and the three ways to get data: no traceback.
        _usage_exit(
            prog,
            f"{err}\nOn the command line: --data.source=torchvision, "
            "--data.source=cifar10-mini or --data.source=synthetic; --data.data_dir=PATH.",
        )
    except (UsageError, CheckpointError) as err:
        _usage_exit(prog, str(err))
    except ArgumentError as err:
        one_line = unknown_option_error(str(err))
        if one_line:
            _usage_exit(prog, one_line)
        # jsonargparse's own parse errors, without its 60-line usage text.
        _usage_exit(
            prog,
            f"{_as_typed(str(err))}{_missing_subcommand_hint(prog, args)}\n"
            f"See `{prog} {_subcommand(args)}--help` for every option.",
        )


def _devices_as_numbers(parser) -> None:
    """``--trainer.devices=2`` is the number 2 (Trainer's hint ``list[int] | str | int``
    reads it as the text ``'2'``, and ``--print_config`` then writes ``devices: '2'``)."""
    for action in parser._actions:
        if getattr(action, "dest", None) == "trainer.devices" and hasattr(action, "_typehint"):
            action._typehint = Union[int, list[int], str]  # noqa: UP007 (a runtime type hint)


def _strategy_names_in_help(parser) -> None:
    """``--trainer.strategy`` in ``fit --help``: the names users type, not Lightning's
    docstring and jsonargparse's list of class paths."""
    for action in parser._actions:
        if getattr(action, "dest", None) == "trainer.strategy":
            action.help = strategy_names_help()
            action.extra_help = _no_extra_help  # not jsonargparse's ", known subclasses: ..."


def _no_extra_help() -> str:
    # A module-level function, not a lambda: Lightning's SaveConfigCallback keeps the parser,
    # and a launch that pickles the Trainer (forkserver, spawn) pickles the parser with it.
    return ""


def _as_typed(message: str) -> str:
    """jsonargparse names options by their keys (``fit.model``, ``Key "trainer.devices"``);
    the user typed ``--model`` and ``--trainer.devices``."""
    message = re.sub(rf"\b(?:{'|'.join(SUBCOMMANDS)})\.([A-Za-z_][\w.]*)", r"--\1", message)
    top = "|".join(TOP_LEVEL_KEYS)
    return re.sub(rf'(?:Parser )?[Kk]ey "((?:{top})(?:\.[\w.]+)?)"', r"--\1", message)


def _missing_subcommand_hint(prog: str, args: list[str] | None) -> str:
    """When no subcommand was typed: which one is missing, as a corrected command."""
    argv = sys.argv[1:] if args is None else list(args)
    if any(a in SUBCOMMANDS for a in argv):
        return ""
    return (
        f"\nThe subcommand is missing: {', '.join(SUBCOMMANDS)} comes first, "
        f"e.g. `{prog} fit {' '.join(argv)}`."
    )


def _subcommand(args: list[str] | None) -> str:
    argv = sys.argv[1:] if args is None else args
    return next((f"{a} " for a in argv if a in SUBCOMMANDS), "")


def _usage_exit(prog: str, message: str) -> None:
    print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2) from None


def _run_cli(args: list[str] | None, prog: str) -> None:
    LightningParCLI(
        ImageClassifier,
        CIFAR10DataModule,
        subclass_mode_model=True,
        seed_everything_default=0,
        save_config_kwargs={"overwrite": True},
        trainer_defaults={
            "callbacks": [ThroughputMonitor(), FitTimeEstimate()],
            "max_epochs": 10,
        },
        parser_kwargs={"prog": prog, "description": description(), "exit_on_error": False},
        args=args,
    )


if __name__ == "__main__":
    main(sys.argv[1:])
