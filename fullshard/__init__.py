"""fullshard: fully sharded data parallelism (FSDP / ZeRO) that never frees what it does not own.

The public names are imported lazily so that ``fullshard.plan`` (pure Python)
can be used without importing any framework.
"""
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "fully_shard": "fullshard.torch.api",
    "FSDPModule": "fullshard.torch.unit",
    "UnshardHandle": "fullshard.torch.unit",
    "GradientReductionHandle": "fullshard.torch.finalize",
    "share_comm_ctx": "fullshard.torch.finalize",
    "register_fsdp_forward_method": "fullshard.torch.unit",
    "MixedPrecisionPolicy": "fullshard.torch.policies",
    "OffloadPolicy": "fullshard.torch.policies",
    "CPUOffloadPolicy": "fullshard.torch.policies",
    "OwnershipError": "fullshard.torch.collectives",
    "set_check_ownership": "fullshard.torch.collectives",
    "set_check_finite": "fullshard.torch.checks",
    "set_check_inputs": "fullshard.torch.checks",
    "memory_report": "fullshard.torch.accounting",
    "clip_grad_norm_": "fullshard.torch.clip",
    "DataParallelMeshDims": "fullshard.torch.collectives",
    "reset_traffic": "fullshard.torch.accounting",
    "save_checkpoint": "fullshard.torch.checkpoint",
    "load_checkpoint": "fullshard.torch.checkpoint",
    "export_checkpoint": "fullshard.torch.checkpoint",
    "full_state_dict": "fullshard.torch.checkpoint",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'fullshard' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_EXPORTS[name]), name)
