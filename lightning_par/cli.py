"""The ``lightning-par`` command: LightningCLI over the example models and CIFAR-10.

Every Trainer flag and every registered strategy name works from the command line and
from a YAML config, e.g.::

    lightning-par fit --model=CifarCNN --data.source=cifar10-mini \\
        --trainer.devices=2 --trainer.strategy=ring_allreduce --trainer.max_epochs=3

After ``fit`` the model is tested (``--test_after_fit=false`` to skip) and one summary
line reports the strategy, the data used, throughput and accuracy.
"""

from __future__ import annotations

import sys

from lightning.pytorch.cli import LightningCLI

import lightning_par  # noqa: F401  (registers the strategy names)
from lightning_par.data import CIFAR10DataModule, DataNotFoundError
from lightning_par.models import CifarCNN, CifarRNN, ImageClassifier  # noqa: F401
from lightning_par.summary import ThroughputMonitor, summary_line


class LightningParCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        parser.add_argument(
            "--test_after_fit", type=bool, default=True, help="Test the model after fit."
        )

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


def main(args: list[str] | None = None) -> None:
    try:
        _run_cli(args)
    except DataNotFoundError as err:
        # The message says what is missing and the three ways to get data: no traceback.
        print(
            f"lightning-par: error: {err}\nOn the command line: --data.source=torchvision, "
            "--data.source=cifar10-mini or --data.source=synthetic; --data.data_dir=PATH.",
            file=sys.stderr,
        )
        raise SystemExit(2) from None


def _run_cli(args: list[str] | None) -> None:
    LightningParCLI(
        ImageClassifier,
        CIFAR10DataModule,
        subclass_mode_model=True,
        seed_everything_default=0,
        save_config_kwargs={"overwrite": True},
        trainer_defaults={"callbacks": [ThroughputMonitor()], "max_epochs": 10},
        args=args,
    )


if __name__ == "__main__":
    main(sys.argv[1:])
