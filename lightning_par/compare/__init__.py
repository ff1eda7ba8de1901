"""Every registered strategy on one model, side by side: ``python -m lightning_par.compare``.

* :mod:`.run`: one ``Trainer.fit`` per strategy, each rank probed (step times, loss, memory);
* :mod:`.breakdown`: a step's time split into compute, communication and waiting, from the
  traces every plugin records;
* :mod:`.costs`: the bytes each plugin's cost model predicts per step;
* :mod:`.analyse` and :mod:`.report`: the rows, the Markdown page and its figures.
"""
