"""fullshard: fully sharded data parallelism (FSDP / ZeRO) that never frees what it does not own."""
from fullshard.api import FSDPModule, UnshardHandle, fully_shard
from fullshard.buffers import OwnershipError, set_check_ownership
from fullshard.policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

__all__ = [
    "CPUOffloadPolicy",
    "FSDPModule",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "OwnershipError",
    "UnshardHandle",
    "fully_shard",
    "set_check_ownership",
]
__version__ = "0.1.0"
