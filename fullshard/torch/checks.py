"""Optional run-time checks, off by default (each costs one attribute read when off).

* ``FULLSHARD_CHECK_FINITE=1`` (or :func:`set_check_finite`): NaN/Inf
  gradients. Each unsharded gradient is tested as autograd delivers it
  (backward order); the first offender per rank is remembered; at the end of
  backward all ranks agree (one small all-gather) and raise together, naming
  the parameter and the rank.
* ``FULLSHARD_CHECK_INPUTS=1`` (or :func:`set_check_inputs`): the root's
  forward inputs must have the same shapes on every rank. Gradients are
  averaged over ranks, so ranks with different batch sizes would silently
  weigh samples unequally. One small all-gather per forward.
"""
from __future__ import annotations

import os
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten

# Read as plain attributes where the step runs (``checks.finite``), so a check that is off costs nothing else.
finite = os.environ.get("FULLSHARD_CHECK_FINITE", "0") not in ("", "0")
inputs = os.environ.get("FULLSHARD_CHECK_INPUTS", "0") not in ("", "0")
_first_offender: Optional[str] = None


def set_check_finite(enabled: bool) -> None:
    global finite
    finite = enabled


def inspect(name: str, grad: Optional[torch.Tensor]) -> None:
    """Remember ``name`` if it is the first parameter this backward whose gradient is not finite."""
    global _first_offender
    if _first_offender is None and grad is not None and not bool(torch.isfinite(grad).all()):
        _first_offender = name


def raise_if_any(process_group: dist.ProcessGroup) -> None:
    """At the end of backward: every rank learns whether any rank saw a non-finite gradient."""
    global _first_offender
    mine, _first_offender = _first_offender, None
    everyone: list = [None] * dist.get_world_size(process_group)
    dist.all_gather_object(everyone, mine, group=process_group)
    offenders = [(rank, name) for rank, name in enumerate(everyone) if name is not None]
    if offenders:
        rank, name = offenders[0]
        raise FloatingPointError(
            f"non-finite gradient (NaN or Inf): first produced for parameter '{name}' on group rank {rank}"
            + (f" (and on {len(offenders) - 1} other ranks)" if len(offenders) > 1 else "")
        )


def set_check_inputs(enabled: bool) -> None:
    global inputs
    inputs = enabled


def check_same_input_shapes(args: Any, kwargs: Any, module_name: str, process_group: dist.ProcessGroup) -> None:
    """Raise on every rank if the tensors passed to the root forward differ in shape across ranks."""
    shapes = [tuple(t.shape) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
    everyone: list = [None] * dist.get_world_size(process_group)
    dist.all_gather_object(everyone, shapes, group=process_group)
    for rank, other in enumerate(everyone):
        if other != shapes:
            raise ValueError(
                f"{module_name}: forward inputs have shapes {shapes} on this rank (group rank "
                f"{dist.get_rank(process_group)}) but {other} on group rank {rank}; gradients are averaged "
                "over ranks, so give every rank batches of the same size"
            )
