"""``python -m lightning_par.zero consolidate FOLDER OUT.ckpt``: one process's checkpoint from
a sharded one (:func:`lightning_par.zero.sharded_checkpoint.consolidate`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from lightning_par.zero.sharded_checkpoint import consolidate, is_sharded_checkpoint


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_par.zero")
    commands = parser.add_subparsers(dest="command", required=True)
    merge = commands.add_parser("consolidate", help="one process's checkpoint from a sharded one")
    merge.add_argument("folder", help="the folder zero(checkpoint='sharded') saved")
    merge.add_argument("out", help="the .ckpt file to write")
    args = parser.parse_args(argv)
    if not is_sharded_checkpoint(args.folder):
        parser.error(f"{args.folder!r} is not a sharded zero checkpoint (no zero_meta.pt in it)")
    checkpoint = consolidate(args.folder)
    torch.save(checkpoint, Path(args.out))
    tensors = len(checkpoint["state_dict"])
    print(f"wrote {args.out}: {tensors} tensors of weights and buffers, "
          f"{len(checkpoint['optimizer_states'])} optimizer state(s)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
