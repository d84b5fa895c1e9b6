"""fullshard on MindSpore 2.10 (PyNative): ``fully_shard`` for Cells, on the same planning code as torch's.

Imports no torch. See ``docs/mindspore.md``.
"""
from fullshard.core.buffers import reset_traffic, traffic_bytes
from fullshard.mindspore.accounting import memory_report
from fullshard.mindspore.api import fully_shard
from fullshard.mindspore.collectives import (
    DeviceMesh, OwnershipError, Shard, comm_bytes, init_device_mesh, reset_peak_comm_bytes, set_check_ownership,
)
from fullshard.mindspore.checkpoint import export_checkpoint, full_state_dict, load_checkpoint, save_checkpoint
from fullshard.mindspore.clip import clip_grad_norm
from fullshard.mindspore.unit import FSDPModule, HSDPModule, UnshardHandle
from fullshard.mindspore.policies import MixedPrecisionPolicy, OffloadPolicy

__all__ = [
    "DeviceMesh",
    "FSDPModule",
    "HSDPModule",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "OwnershipError",
    "Shard",
    "UnshardHandle",
    "clip_grad_norm",
    "comm_bytes",
    "export_checkpoint",
    "full_state_dict",
    "fully_shard",
    "init_device_mesh",
    "load_checkpoint",
    "memory_report",
    "reset_peak_comm_bytes",
    "reset_traffic",
    "save_checkpoint",
    "set_check_ownership",
    "traffic_bytes",
]
