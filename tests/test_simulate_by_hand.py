"""``simulate.predict_step``: the simulator checks a data-parallel step predicted by hand."""

from __future__ import annotations

import pytest

from lightning_par import simulate
from lightning_par.simulate.links import Link


def test_the_ring_formula_by_hand_is_what_the_simulator_predicts():
    link = Link("hand", alpha=1e-3, beta=1e-6)
    # 4 devices, 4000 B of gradients: 2 (p - 1) = 6 messages of 1000 B each
    by_hand = 0.5 + 6 * (1e-3 + 1e-6 * 1000)
    assert simulate.predict_step(0.5, 4000, 4, link) == pytest.approx(by_hand)
    parts = simulate.step_parts(0.5, 4000, 4, link)
    assert parts["messages"] == 6 and parts["bytes_per_message"] == pytest.approx(1000)
    assert parts["step_s"] == pytest.approx(by_hand)


def test_presets_algorithms_and_overlap():
    nvlink = simulate.PRESETS["nvlink"]
    one_gb = 10**9
    ring = simulate.predict_step(0.0, one_gb, 8, "nvlink")
    assert ring == pytest.approx(14 * (nvlink.alpha + nvlink.beta * one_gb / 8), rel=1e-6)
    tree = simulate.predict_step(0.0, one_gb, 8, "nvlink", algorithm="tree")
    assert tree > ring  # the tree sends the whole tensor at every level
    # backward overlapped with four buckets hides most of the allreduce behind it
    serial = simulate.predict_step(1.0, one_gb, 8, "eth100")
    hidden = simulate.predict_step(1.0, one_gb, 8, "eth100", backward_s=0.6, buckets=4)
    assert hidden < serial


def test_bad_input_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="not one of"):
        simulate.predict_step(1.0, 100, 2, "nvlnk")
    with pytest.raises(ValueError, match="devices and buckets >= 1"):
        simulate.predict_step(1.0, 100, 0)
    with pytest.raises(ValueError, match="backward_s must be between"):
        simulate.predict_step(1.0, 100, 2, backward_s=2.0)
