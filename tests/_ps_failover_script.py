"""A user's script, run by ``tests/test_parameter_server_failover.py`` as ``python
_ps_failover_script.py OUT [--clip] SERVERS:FAULT ...``: for each argument, one ``fit`` of a
small network on two CPU ranks (Lightning chooses the launch) with
``ParameterServerStrategy(num_servers=SERVERS, fault_tolerant=True)`` and
``LIGHTNING_PAR_FAULT=FAULT``; ``FAULT`` ``none`` is the reference: the plain parameter
server, nothing lost. The final weights of scenario ``i`` go to ``OUT/i.pt``; ``--clip``
clips the gradient by norm. Each scenario starts with a line ``SCENARIO i`` on stderr."""

from __future__ import annotations

import os
import sys

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_par.launch.faults import FAULT_ENV
from lightning_par.strategies.parameter_server import ParameterServerStrategy

#: Seconds a rank may stop responding (the strategy's ``dead_peer_timeout``).
DEAD_PEER_S = 2.0


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)


def fit(out: str, servers: int, fault: str, clip: bool) -> None:
    os.environ[FAULT_ENV] = "" if fault == "none" else fault  # read as the servers start
    strategy = ParameterServerStrategy(
        num_servers=servers, fault_tolerant=fault != "none", split_mb=1e-4,
        dead_peer_timeout=DEAD_PEER_S,
    )  # fmt: skip
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=2, max_epochs=1, logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        gradient_clip_val=0.05 if clip else None,
    )  # fmt: skip
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 8, generator=g), torch.randint(0, 4, (64,), generator=g))
    model = Tiny()
    trainer.fit(model, DataLoader(data, batch_size=4))
    if trainer.global_rank == 0:  # (popen: every rank runs this script)
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, out)


if __name__ == "__main__":
    folder, *scenarios = sys.argv[1:]
    clip = "--clip" in scenarios
    for i, scenario in enumerate(s for s in scenarios if s != "--clip"):
        servers, fault = scenario.split(":", 1)
        if os.environ.get("LOCAL_RANK", "0") == "0":  # (popen: not again in the re-run script)
            print(f"SCENARIO {i}", file=sys.stderr, flush=True)
        fit(os.path.join(folder, f"{i}.pt"), int(servers), fault, clip)
