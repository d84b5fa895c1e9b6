"""Sharded checkpoints on torch.distributed.checkpoint (DCP), saved atomically.

A checkpoint is a DCP directory ``step_<N>``. It is written as
``step_<N>.partial`` by every rank and renamed by rank 0 only after all ranks
finished, so an interrupted save never replaces or corrupts the last
complete checkpoint: :func:`latest_step` only ever sees complete ones.
"""
from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any, Optional

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

_COMPLETE = re.compile(r"^step_(\d+)$")


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step}"


def latest_step(root: Path) -> Optional[int]:
    if not root.is_dir():
        return None
    steps = [int(m.group(1)) for p in root.iterdir() if (m := _COMPLETE.match(p.name)) and p.is_dir()]
    return max(steps, default=None)


def save_atomic(state: dict[str, Any], root: Path, step: int) -> Path:
    """Save ``state`` (DTensor state dicts) collectively; the directory appears only when complete."""
    final = step_dir(root, step)
    partial = final.with_name(final.name + ".partial")
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    if dist.is_initialized():
        dist.barrier()
    dcp.save(state, checkpoint_id=str(partial))
    if dist.is_initialized():
        dist.barrier()
    if rank == 0:
        if final.exists():
            shutil.rmtree(final)
        os.replace(partial, final)
    if dist.is_initialized():
        dist.barrier()
    return final


def load_into(state: dict[str, Any], root: Path, step: int) -> None:
    """Load checkpoint ``step`` into ``state`` in place (DCP resharding to the current layout)."""
    dcp.load(state, checkpoint_id=str(step_dir(root, step)))
