"""``python -m lightning_par.bench layerwise`` measures what it claims: the activation and
gradient bytes of the workload cross between the stages, in one message per chunk, and the
naive split's stages never work at the same time."""

import json

from lightning_par.bench.layerwise import BATCH, HIDDEN, SEQ, main, workload


def test_layerwise_bench_runs(capsys):
    argv = ["--time-chunks", "16", "--steps", "1", "--rounds", "2", "--warmup", "0", "--json"]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    rows = result["rows"]
    assert [(r["variant"], r["chunks"]) for r in rows] == [("naive split", 1), ("wavefront", 4)]
    assert result["one_process_s"] > 0 and result["two_at_once_s"] > 0
    for row in rows:
        assert row["step_s"] > 0 and row["one_process_chunked_s"] > 0
        assert len(row["compute_s"]) == len(row["bytes_sent"]) == 2
        # stage 0 sends the LSTM's output sequence forward, stage 1 its gradient back and
        # the network's B x 10 output to stage 0 (which runs the loss too): the workload's
        # B x T x H floats each way per step, nothing else
        activations = BATCH * SEQ * HIDDEN * 4
        assert row["bytes_sent"] == [activations, activations + BATCH * 10 * 4], row["variant"]
        # each stage holds its own layers: the parameter bytes add up to the model's
        net = workload()[0]
        total = sum(p.numel() * p.element_size() for p in net.parameters())
        assert sum(m["param_bytes"] for m in row["memory"]) == total
        assert all(m["activation_bytes"] > 0 for m in row["memory"])
    # the wavefront cuts those bytes into one message per chunk each way (and the output)
    naive, wave = rows
    assert naive["messages_sent"] == [1, 2] and wave["messages_sent"] == [4, 5]
    assert wave["utilisation_theory"] == 4 / 5 and naive["utilisation_theory"] == 1 / 2
    # the naive split's stages wait for each other's whole sequence: one stage works at a
    # time, so about half of the two stages' time is busy at most, however fast the machine
    # (the slack: a span ends just after posting its message, which the peer may take first)
    assert 0 < naive["utilisation_measured"] <= 0.52
