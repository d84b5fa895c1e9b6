"""Optional check for NaN/Inf gradients (``FULLSHARD_CHECK_FINITE=1`` or :func:`set_check_finite`).

When on, each unsharded gradient is tested as autograd delivers it (backward
order), the first offender per rank is remembered, and at the end of
backward all ranks agree (one small all-gather) and raise together, naming
the parameter and the rank. When off, the cost is one boolean test per
gradient.
"""
from __future__ import annotations

import os
from typing import Optional

import torch
import torch.distributed as dist

_enabled = os.environ.get("FULLSHARD_CHECK_FINITE", "0") not in ("", "0")
_first_offender: Optional[str] = None


def set_check_finite(enabled: bool) -> None:
    global _enabled
    _enabled = enabled


def check_finite_enabled() -> bool:
    return _enabled


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
