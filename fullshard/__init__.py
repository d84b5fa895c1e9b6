"""fullshard: fully sharded data parallelism (FSDP / ZeRO) that never frees what it does not own.

The public names are imported lazily so that ``fullshard.plan`` (pure Python)
can be used without importing any framework.
"""
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "fully_shard": "fullshard.api",
    "FSDPModule": "fullshard.api",
    "UnshardHandle": "fullshard.api",
    "register_fsdp_forward_method": "fullshard.api",
    "MixedPrecisionPolicy": "fullshard.policies",
    "OffloadPolicy": "fullshard.policies",
    "CPUOffloadPolicy": "fullshard.policies",
    "OwnershipError": "fullshard.buffers",
    "set_check_ownership": "fullshard.buffers",
    "set_check_finite": "fullshard.runtime.checks",
    "set_check_inputs": "fullshard.runtime.checks",
    "memory_report": "fullshard.accounting",
    "reset_traffic": "fullshard.accounting",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'fullshard' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_EXPORTS[name]), name)
