"""The pipeline strategies' schedule options, checked with no Lightning in sight:
:class:`~lightning_par.strategies.gpipe.GPipeStrategy` (and the hybrid grid's pipelines)
call these.

* ``schedule="gpipe"`` or ``"1f1b"``: one stage per device;
* ``schedule="interleaved"`` (``virtual_stages`` stages per device, ``chunks`` a multiple of
  the devices) or ``"zero_bubble"`` (ZB-H1, one stage per device, no re-materialisation).
"""

from __future__ import annotations


def resolve_checkpoint(checkpoint: str | None, schedule: str) -> str:
    """``None`` means torchgpipe's ``"except_last"``, but ``"never"`` under zero bubble."""
    if checkpoint is None:
        return "never" if schedule == "zero_bubble" else "except_last"
    return checkpoint


def check_options(schedule: str, virtual_stages: object, checkpoint: str,
                  plugin: str = "gpipe") -> None:  # fmt: skip
    """Refuse what the chosen schedule cannot run, naming the plugin, the option and the fix."""
    v = virtual_stages
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"{plugin}: virtual_stages must be an int >= 1, got {virtual_stages!r}")
    if schedule == "zero_bubble" and checkpoint != "never":
        raise ValueError(
            f"{plugin}: schedule='zero_bubble' refuses checkpoint={checkpoint!r}: its "
            "weight-gradient step W reuses the activations the input-gradient step B used, so "
            "re-materialising would run each forward twice more; use checkpoint='never' (or "
            "leave it out), or schedule='interleaved' to re-materialise"
        )


def check_chunks(plugin: str, schedule: str, chunks: int, devices: int) -> None:
    """Interleaved 1F1B needs ``chunks`` to be a multiple of the devices (Megatron's rule)."""
    if schedule == "interleaved" and chunks % devices:
        lower = max(devices, chunks - chunks % devices)
        raise ValueError(
            f"{plugin}: schedule='interleaved' needs chunks to be a multiple of the {devices} "
            f"devices (micro-batches go round the stages in groups of {devices}), got "
            f"chunks={chunks}: use chunks={chunks + devices - chunks % devices} or {lower}"
        )
