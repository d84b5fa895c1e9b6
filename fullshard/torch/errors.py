"""Errors for misuse, each an instance of the type FSDP2 raises for the same misuse (clients catch those)
and of the type fullshard raised before, so code written against either keeps working.

Messages keep FSDP2's wording as their first sentence, then say what fullshard found and the fix.
"""
from __future__ import annotations


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
