"""``flow.py one`` for several networks and data-parallel sizes in turn, in one interpreter:
the same one-process flow each time (every network is built from seed 0 and read in a fixed
order, so a run does not depend on the ones before it), the imports paid once.

    python baselines.py OUT_DIR BATCH NETWORK:REPLICAS ...

writes ``OUT_DIR/one-NETWORK-REPLICAS/result.pt`` for each (see :func:`run.baselines`).
"""

from __future__ import annotations

import sys
from pathlib import Path

import flow

if __name__ == "__main__":
    out, batch = Path(sys.argv[1]), sys.argv[2]
    for pair in sys.argv[3:]:
        network, replicas = pair.split(":")
        folder = out / f"one-{network}-{replicas}"
        folder.mkdir(parents=True, exist_ok=True)
        flow.main(["one", network, str(folder), "--batch", batch, "--replicas", replicas])
