"""``python -m lightning_par`` is the ``lightning-par`` command."""

from lightning_par.cli import main

main(prog="python -m lightning_par")
