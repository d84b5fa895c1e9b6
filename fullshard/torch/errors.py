"""Errors for misuse, each an instance of the type FSDP2 raises for the same misuse (clients catch those)
and of the type fullshard raised before, so code written against either keeps working.

Messages keep FSDP2's wording as their first sentence, then say what fullshard found and the fix.
"""
from __future__ import annotations

from typing import Any

from torch.distributed.tensor import DTensor


class AppliedTwiceError(ValueError, AssertionError):
    """fully_shard on a module that already has it (FSDP2: AssertionError)."""


class DeepcopyError(TypeError, AssertionError):
    """copy.deepcopy of a sharded module (FSDP2: AssertionError)."""


class ShardDimError(ValueError, AssertionError):
    """A shard dim outside the parameter's dims (FSDP2: AssertionError)."""


class MeshError(ValueError, AssertionError):
    """A mesh fully_shard cannot use, e.g. 2-D without dim names (FSDP2: AssertionError or ValueError)."""


class NotMaterializedError(RuntimeError):
    """Parameters still on the meta device at the first forward (FSDP2: RuntimeError)."""


def check_replacement(current: Any, fqn: str, shape: Any, placements: tuple) -> None:
    """A parameter replaced after fully_shard (``to_empty``, ``load_state_dict(assign=True)``) must stay a DTensor
    of its shape, placed as fully_shard placed it."""
    if not isinstance(current, DTensor) or current.shape != shape:
        raise RuntimeError(
            f"parameter '{fqn}' was replaced by a {type(current).__name__} of shape "
            f"{tuple(getattr(current, 'shape', ()))}; after fully_shard it must stay a DTensor "
            f"of shape {tuple(shape)} sharded like the original. Load full tensors with "
            "load_state_dict (without assign=True) instead."
        )
    if tuple(current.placements) != placements:
        raise RuntimeError(
            f"parameter '{fqn}' was replaced by a DTensor placed {current.placements}; fully_shard placed it {placements}"
        )
