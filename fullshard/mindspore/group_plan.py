"""What one communication group will do, asked of ``fullshard.plan`` once: buckets, collectives, names, dtypes.

Nothing here touches a tensor's data. Renames happen when the root learns
the cells' paths.
"""
from __future__ import annotations

from typing import Any, Optional

from fullshard.core.units import BucketNames
from fullshard.mindspore.param import ShardedParam
from fullshard.mindspore.policies import dtype_name, dtype_named
from fullshard.plan import MINDSPORE_RUNTIME, GatherPlan, Unsharded, plan_buckets, plan_gather, plan_replica
from fullshard.plan.backends import Backend, Collectives, carrier_dtype, is_bit_cast
from fullshard.plan.exchange import Exchange


class GroupPlan(BucketNames):
    owner_kind = "cell"

    def __init__(
        self,
        params: list[ShardedParam],
        reduce_dtype: Optional[Any],
        module_name: str,
        fuse_below_numel: int,
        collectives: Collectives,
        backend: Backend,
    ) -> None:
        self.params = params
        self.module_name = module_name
        self._reduce_dtype = reduce_dtype
        self.collectives = collectives
        self.backend = backend
        self.layouts = tuple(p.layout for p in params)
        # Only parameters of the same dtypes and trainability share a buffer.
        kinds = tuple((p.stored_dtype, p.compute_dtype, p.requires_grad) for p in params)
        self.fuse_below_numel = fuse_below_numel  # gradients this large are reduced alone, too
        self.buckets = plan_buckets(self.layouts, fuse_below_numel, kinds)
        self._name_buckets()
        for index, bucket in enumerate(self.buckets):  # every dtype must travel: refused now, not in a bprop
            param = params[bucket.members[0]]
            try:
                self.gather_carrier(index)
                if param.requires_grad:
                    self.wire_dtype(self.reduce_dtype(param))
            except ValueError as error:
                raise ValueError(
                    f"fully_shard({module_name}): parameter '{param.fqn}' ({param.stored_dtype}, computing in "
                    f"{param.compute_dtype}): {error}; or set MixedPrecisionPolicy(param_dtype=..., reduce_dtype=...)"
                ) from None
        self.gather_plans: list[GatherPlan] = [
            plan_gather(b, self.layouts, cast_needed=params[b.members[0]].converts_for_compute,
                        exchange=collectives.gather, runtime=MINDSPORE_RUNTIME, bit_cast=self.gather_carrier(i)[1])
            for i, b in enumerate(self.buckets)
        ]
        # no_shard / replicate_params: what each replica computes with (nothing is gathered)
        self.replica_plans: list[Unsharded] = [plan_replica(p.converts_for_compute) for p in params]

    def reduce_dtype(self, param: ShardedParam) -> Any:
        return self._reduce_dtype or param.compute_dtype

    def gather_carrier(self, index: int) -> tuple[Any, bool]:
        """The dtype bucket ``index`` travels in for its all-gather, and whether that is a bit cast."""
        dtype = dtype_name(self.members(index)[0].compute_dtype)
        carrier = carrier_dtype(self.backend, dtype, summed=self.collectives.gather is Exchange.ZERO_FILLED_ALL_REDUCE)
        return dtype_named(carrier), is_bit_cast(dtype, carrier)

    def wire_dtype(self, reduce_dtype: Any) -> Any:
        """The dtype gradients reduced in ``reduce_dtype`` are summed in on the wire (the same on every rank)."""
        return dtype_named(carrier_dtype(self.backend, dtype_name(reduce_dtype), summed=True))
