"""Framework-free planning: layouts, buckets and buffer ownership (no torch import)."""
from fullshard.plan.exchange import Exchange, choose_exchange, exchange_tag, reduce_scratch_chunks, wire_dtype
from fullshard.plan.layout import BucketLayout, ShardLayout, ceil_div, members_are_row_blocks, plan_buckets
from fullshard.plan.ownership import (
    GatherPlan,
    Ownership,
    ReducePlan,
    ShardedGrad,
    Unsharded,
    grad_copy_may_be_async,
    plan_gather,
    plan_reduce,
    stores_padded_chunk,
)

__all__ = [
    "BucketLayout",
    "Exchange",
    "GatherPlan",
    "Ownership",
    "ReducePlan",
    "ShardLayout",
    "ShardedGrad",
    "Unsharded",
    "ceil_div",
    "choose_exchange",
    "exchange_tag",
    "grad_copy_may_be_async",
    "members_are_row_blocks",
    "plan_buckets",
    "plan_gather",
    "plan_reduce",
    "reduce_scratch_chunks",
    "stores_padded_chunk",
    "wire_dtype",
]
