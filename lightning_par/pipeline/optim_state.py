"""The optimiser state of a model split into stages, in the format of one process.

Each stage's optimiser holds only its stage's parameters (plus those every stage keeps, e.g.
owned by the LightningModule itself), numbered from 0. A checkpoint must hold what the
user's optimiser on the whole model would save (``torch.optim.Optimizer.state_dict``): the
parameters of each group numbered consecutively across groups, in the model's order. Then
a checkpoint written by a pipeline resumes under any strategy, or in one process, and back.

Parameters are matched by name (a split network keeps its layers' original names):

* :func:`model_order`: the whole model's parameter names from each stage's names;
* :func:`merge_stage_states`: the stages' ``state_dict()`` results as one optimiser's;
* :func:`stage_state`: one stage's part of such a state, for its ``load_state_dict``.
"""

from __future__ import annotations

from typing import Any


def model_order(stage_names: list[list[str]], prefix: str) -> list[str]:
    """The whole model's parameter names in ``named_parameters`` order, from every stage's
    own list (``stage_names[s]``): the split network's names (starting with ``prefix``)
    are per stage and consecutive; the others every stage has in the same places."""
    network = [n for names in stage_names for n in names if n.startswith(prefix)]
    order: list[str] = []
    for name in stage_names[0]:
        if not name.startswith(prefix):
            order.append(name)
        elif network:
            order += network
            network = []
    return order + network


def _groups(
    stage_group_names: list[list[list[str]]], order: list[str]
) -> list[list[str]]:  # fmt: skip
    """Each group's parameter names over all stages, in the model's order."""
    counts = {len(groups) for groups in stage_group_names}
    if len(counts) != 1:
        raise ValueError(f"the stages' optimisers have different numbers of groups: {counts}")
    position = {name: i for i, name in enumerate(order)}
    merged = []
    for g in range(counts.pop()):
        names = {n for groups in stage_group_names for n in groups[g]}
        merged.append(sorted(names, key=lambda n: position.get(n, len(position))))
    return merged


def merge_stage_states(
    states: list[dict[str, Any]],
    stage_group_names: list[list[list[str]]],
    order: list[str],
) -> dict[str, Any]:
    """One optimiser state dict for the whole model from every stage's ``state_dict()``;
    ``stage_group_names[s][g]``: the names of stage ``s``'s group ``g``, in its order. A
    parameter every stage holds is taken from the first stage."""
    groups = _groups(stage_group_names, order)
    where: dict[str, tuple[int, int]] = {}  # name -> (stage, its index there)
    for s, (state, names) in enumerate(zip(states, stage_group_names)):
        for group, group_names in zip(state["param_groups"], names):
            for index, name in zip(group["params"], group_names):
                where.setdefault(name, (s, index))
    full_state: dict[int, Any] = {}
    full_groups = []
    number = 0
    for g, names in enumerate(groups):
        ids = []
        for name in names:
            s, index = where[name]
            if index in states[s]["state"]:
                full_state[number] = states[s]["state"][index]
            ids.append(number)
            number += 1
        settings = {k: v for k, v in states[0]["param_groups"][g].items() if k != "params"}
        full_groups.append({**settings, "params": ids})
    return {"state": full_state, "param_groups": full_groups}


def stage_state(
    full: dict[str, Any],
    stage: int,
    stage_group_names: list[list[list[str]]],
    order: list[str],
) -> dict[str, Any]:
    """Stage ``stage``'s optimiser state (for ``load_state_dict``) from the whole model's."""
    groups = _groups(stage_group_names, order)
    saved = full["param_groups"]
    sizes = [len(g["params"]) for g in saved]
    if sizes != [len(g) for g in groups]:
        raise ValueError(
            f"the checkpoint's optimiser has {sizes} parameters per group, this model's "
            f"optimiser {[len(g) for g in groups]}: it was saved for another model or "
            "another configure_optimizers"
        )
    mine = stage_group_names[stage]
    local_state: dict[int, Any] = {}
    local_groups = []
    number = 0
    for g, names in enumerate(groups):
        full_id = dict(zip(names, saved[g]["params"]))
        ids = []
        for name in mine[g]:
            if full_id[name] in full["state"]:
                local_state[number] = full["state"][full_id[name]]
            ids.append(number)
            number += 1
        settings = {k: v for k, v in saved[g].items() if k != "params"}
        local_groups.append({**settings, "params": ids})
    return {"state": local_state, "param_groups": local_groups}
