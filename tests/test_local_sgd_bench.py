"""``python -m lightning_par.bench local_sgd`` measures what it says: the bytes each contender
sent are the cost model's for its number of allreduces, and accuracy is counted on the test
images it names."""

import json

from lightning_par.bench.local_sgd import main
from lightning_par.collectives.averaging import averaged_tensors
from lightning_par.collectives.cost_model import predict
from lightning_par.comm.buckets import make_buckets
from lightning_par.models import CifarCNN

BATCHES, BATCH = 8, 32


def test_local_sgd_bench_sends_the_models_bytes(capsys, mini_dir):
    argv = ["--epochs", "1", "--limit-batches", str(BATCHES), "--slowdowns", "3", "--json"]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    rows = {row["strategy"]: row for row in result["rows"]}
    assert list(rows) == ["ring_allreduce", "local_sgd(period=4)", "local_sgd(period=None)"]
    model = CifarCNN(width=result["width"], num_blocks=result["num_blocks"])

    def ring_bytes(numel: int) -> int:  # rank 0's bytes for one ring allreduce on 2 ranks
        return predict("ring", numel, 2).bytes_sent[0]

    # Local SGD averages every parameter and floating buffer, flattened into one tensor:
    # after steps 4 and 8 with period 4, once at the end of the epoch with period None.
    averaged = sum(t.numel() for t in averaged_tensors(model))
    assert rows["local_sgd(period=4)"]["rank0_bytes_sent"] == 2 * ring_bytes(averaged)
    assert rows["local_sgd(period=None)"]["rank0_bytes_sent"] == ring_bytes(averaged)
    # The ring strategy sums every gradient bucket (4 MiB buckets, one flag per parameter)
    # after each of the 8 steps.
    params = [p for p in model.parameters() if p.requires_grad][::-1]
    per_step = sum(ring_bytes(b.buffer.numel()) for b in make_buckets(params, 4 << 20))
    assert rows["ring_allreduce"]["rank0_bytes_sent"] == BATCHES * per_step
    for row in rows.values():
        assert row["rank1_images"] == BATCHES * BATCH  # --limit-batches caps the straggler too
        # accuracy is a count of correct images among the 2 x 8 x 32 tested
        correct = row["test_acc"] * 2 * BATCHES * BATCH
        assert abs(correct - round(correct)) < 1e-3, row["test_acc"]
