"""What one communication group will do, asked of ``fullshard.plan`` once: buckets, exchange, names, dtypes.

Nothing here touches a tensor's data. The group re-plans (a new
:class:`GroupPlan`) only when the user replaces parameters (new dtype or
device), and renames when the root learns the modules' paths.
"""
from __future__ import annotations

import os
from typing import Any, Optional

import torch
import torch.distributed as dist

from fullshard.core.units import BucketNames
from fullshard.plan import (
    Accumulation, Exchange, GatherPlan, Unsharded, choose_exchange, exchange_tag, plan_accumulation, plan_buckets,
    plan_gather, plan_replica, wire_dtype,
)
from fullshard.plan.exchange import EXCHANGE_ENV
from fullshard.plan.layout import DEFAULT_FUSE_BELOW_NUMEL
from fullshard.torch.param import ShardedParam


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16": how the planning code names dtypes."""
    return str(dtype).removeprefix("torch.")


class GroupPlan(BucketNames):
    def __init__(
        self,
        params: list[ShardedParam],
        process_group: dist.ProcessGroup,
        world: int,
        reduce_dtype: Optional[torch.dtype],
        module_name: str,
        fuse_below_numel: Optional[int] = None,
        custom_all_gather: Any = None,
        custom_reduce_scatter: Any = None,
    ) -> None:
        self.params = params
        self.module_name = module_name
        self._reduce_dtype = reduce_dtype
        layouts = tuple(p.layout for p in params)
        self.layouts = layouts
        # Only parameters of the same dtypes and trainability share a buffer; one whose local tensor
        # has all-gather extensions (fsdp_pre/post_all_gather) travels alone, the way its hooks say.
        kinds = tuple(
            ("extension", index) if p.extension is not None else (p.stored_dtype, p.compute_dtype, p.requires_grad)
            for index, p in enumerate(params)
        )
        self.fuse_below_numel = DEFAULT_FUSE_BELOW_NUMEL if fuse_below_numel is None else fuse_below_numel
        self.buckets = plan_buckets(layouts, self.fuse_below_numel, kinds)
        self.exchange = choose_exchange(
            dist.get_backend(process_group), params[0].device.type, world, os.environ.get(EXCHANGE_ENV)
        )
        # FSDPModule.set_custom_all_gather / set_custom_reduce_scatter: the user's collectives.
        self.custom_all_gather, self.custom_reduce_scatter = custom_all_gather, custom_reduce_scatter
        self.gather_exchange = Exchange.CUSTOM if custom_all_gather is not None else self.exchange
        self.reduce_exchange = Exchange.CUSTOM if custom_reduce_scatter is not None else self.exchange
        self.gather_plans: list[GatherPlan] = [
            plan_gather(b, layouts, cast_needed=params[b.members[0]].converts_for_compute,
                        exchange=self.gather_exchange)
            for b in self.buckets
        ]
        # no_shard: what each replica computes with (nothing is gathered)
        self.replica_plans: list[Unsharded] = [plan_replica(p.cast_needed) for p in params]
        # where each parameter's gradients are summed while gradient sync is off
        self.accumulations: list[Accumulation] = [
            plan_accumulation(p.compute_dtype == self.reduce_dtype(p)) for p in params
        ]
        self._name_buckets()

    def _name_buckets(self) -> None:
        """Labels for messages, and the point-to-point tags derived from them (the same on every rank)."""
        super()._name_buckets()
        self.gather_tags = [exchange_tag(label, "all_gather") for label in self.labels]
        self.reduce_tags = [exchange_tag(label, "reduce_scatter") for label in self.labels]

    def reduce_dtype(self, param: ShardedParam) -> torch.dtype:
        return self._reduce_dtype or param.compute_dtype

    def gradient_wire_dtype(self, compute_dtype: torch.dtype, reduce_dtype: torch.dtype, all_reduce: bool,
                            accumulated_without_sync: bool) -> torch.dtype:
        """The dtype a bucket's gradients travel in (``plan.exchange.wire_dtype``), the same on every rank.

        Decided from what every rank shares (dtypes, the exchange, whether sync
        was off), never from the gradients this rank happens to hold: both ends
        of each message must agree on its size. A gradient in another dtype is
        cast into an owned input. All-reduce and accumulators: the reduce dtype.
        """
        if all_reduce or accumulated_without_sync:
            return reduce_dtype
        return getattr(torch, wire_dtype(self.reduce_exchange, dtype_name(compute_dtype), dtype_name(reduce_dtype)))
