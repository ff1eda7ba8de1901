"""Every registered strategy on one model, side by side: ``python -m lightning_par.compare``.

* :mod:`lightning_par.measure`: one ``Trainer.fit`` per strategy, each rank probed (step
  times, loss, memory), and each step's time split into compute, communication and waiting
  from the traces every plugin records;
* :mod:`.costs`: the bytes each plugin's cost model predicts per step;
* :mod:`.rows` and :mod:`.report`: the rows, the Markdown page and its figures;
* :mod:`.predicted`: the simulator (:mod:`lightning_par.simulate`) on the report's own runs.
"""
