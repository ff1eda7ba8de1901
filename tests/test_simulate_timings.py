"""A validation's folder keeps what the scale-out timed (:mod:`lightning_par.simulate.timings`),
so that ``--validate --reuse`` scores it the same every time, whatever the load then."""

from __future__ import annotations

import json

from lightning_par.simulate import timings
from lightning_par.simulate.stage_share import layer_weights
from lightning_par.simulate.tp_share import busiest_share


def test_the_first_scoring_keeps_its_timings_and_later_ones_read_them(tmp_path):
    write = timings.keep_in(tmp_path)
    timed = layer_weights("CifarCNN", 4)
    share = busiest_share("CifarCNN", 2, 4)
    write()
    kept = json.loads((tmp_path / timings.FILE).read_text())
    assert kept == {"layer_weights/CifarCNN/4": list(timed), "busiest_share/CifarCNN/2/4": share}
    # a later scoring (another process, another load) reads them, and times nothing again
    kept["layer_weights/CifarCNN/4"] = [1.0, 2.0, 3.0, 4.0]
    kept["busiest_share/CifarCNN/2/4"] = 0.5
    (tmp_path / timings.FILE).write_text(json.dumps(kept))
    timings.keep_in(tmp_path)  # (clears what this process cached, as a new process has none)
    assert layer_weights("CifarCNN", 4) == (1.0, 2.0, 3.0, 4.0)
    assert busiest_share("CifarCNN", 2, 4) == 0.5
    # a folder of its own starts afresh; FLOPs (micro-batch 0) are never timed
    other = tmp_path / "other"
    other.mkdir()
    timings.keep_in(other)()
    assert layer_weights("CifarCNN", 0) == layer_weights("CifarCNN", 0)
    assert json.loads((other / timings.FILE).read_text()) == {}
    timings.keep_in(other)
    assert layer_weights("CifarCNN", 4) != (1.0, 2.0, 3.0, 4.0)
