"""Smoke test of ``python -m lightning_par.bench tensor_parallel``: our column/row block and
torch's DTensor one run in the same ranks, give the same output, and move what the cost
model says (ours, traced) and the same collectives (torch's, counted)."""

import json

from lightning_par.bench.tensor_parallel import main


def test_tensor_parallel_bench_runs(capsys):
    argv = ["--world", "3", "--dim", "12", "--hidden", "24", "--tokens", "8", "--steps", "1",
            "--rounds", "1", "--warmup", "0", "--json"]  # fmt: skip
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    ours, theirs, alone = result["rows"]
    assert [r["variant"] for r in result["rows"]] == ["ours", "torch DTensor", "one process"]
    assert result["max_abs_output_diff"] < 1e-5
    assert all(r["step_s"] > 0 for r in result["rows"])
    assert result["ring_allreduce_s"] > 0 and result["gloo_allreduce_s"] > 0
    # ours: every rank's traced bytes are the cost model's (f backward + g forward, 8 x 12
    # floats each, a ring on 3 ranks: 2 x 2/3 of 384 B each way)
    assert ours["bytes_sent_per_step"] == ours["predicted_bytes_per_step"]
    assert ours["bytes_sent_per_step"] == [1024] * 3
    # torch moves the same two allreduces (forward g, backward f) of the same payload
    assert theirs["collectives"] == ["all_reduce"] and theirs["collectives_per_step"] == 2
    assert theirs["payload_bytes_per_step"] == ours["payload_bytes_per_step"] == 2 * 8 * 12 * 4
