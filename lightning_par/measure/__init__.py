"""Measured runs: one ``Trainer.fit`` per row, every rank probed, and what the probes and
traces say. The compare report (:mod:`lightning_par.compare`) sets the rows side by side; the
simulator (:mod:`lightning_par.simulate`) replays them and checks its predictions against
them.

* :mod:`.run`: the rows, one after the other in a subprocess (``python -m
  lightning_par.measure``), the compared models;
* :mod:`.probe`: what every rank writes (step times, losses, memory) and reading it back;
* :mod:`.breakdown`: a step's time split into compute, communication and waiting, from the
  traces every plugin records;
* :mod:`.analyse`: one run's times, bytes, memory and loss per step.
"""
