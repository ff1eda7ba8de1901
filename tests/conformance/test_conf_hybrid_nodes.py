"""Where hybrid's model-parallel groups fall on nodes (:func:`lightning_par.hybrid.grid.
groups_across_nodes`): within a node when mp divides the processes per node, else named."""

from __future__ import annotations

import pytest

from lightning_par.hybrid.grid import Grid, groups_across_nodes


@pytest.mark.parametrize("dp, mp, per_node", [(2, 2, 2), (2, 2, 4), (4, 1, 1), (2, 4, 4)])
def test_model_parallel_groups_within_a_node_pass(dp, mp, per_node):
    assert groups_across_nodes(Grid(dp, mp), per_node) is None


@pytest.mark.parametrize("dp, mp, per_node, group", [(1, 2, 1, "[0, 1]"), (2, 3, 2, "[0, 1, 2]"),
                                                     (1, 4, 2, "[0, 1, 2, 3]")])  # fmt: skip
def test_model_parallel_groups_across_nodes_are_named_with_the_fix(dp, mp, per_node, group):
    reason = groups_across_nodes(Grid(dp, mp), per_node)
    assert reason is not None and f"group {group} (mp={mp}) spans nodes" in reason
    assert f"choose mp dividing the processes per node ({per_node})" in reason
