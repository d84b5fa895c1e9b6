"""What one communication group will do, decided once for both runtimes: buckets, how each travels, who owns its
buffers, the dtypes on the wire, names (pure).

A runtime describes its parameters in framework-free facts (:class:`ParamFacts`: a layout, dtype names,
trainability) and its group's collectives; :class:`GroupPlan` asks ``plan.layout``, ``plan.exchange`` and
``plan.ownership`` once and keeps the answers. Nothing here touches a tensor. Dtypes are names ("bfloat16");
a runtime turns them into its own. The parameters themselves (the runtime's objects, with ``fqn`` and
``local_fqn``) are only named: errors and profiler labels name them by their path from the root, which is
known once the root adopts the unit (:meth:`GroupPlan.rename`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

from fullshard.plan.exchange import Backend, Collectives, Exchange, carrier_dtype, exchange_tag, is_bit_cast, wire_dtype
from fullshard.plan.layout import BucketLayout, ShardLayout, plan_buckets
from fullshard.plan.ownership import (
    TORCH_RUNTIME, Accumulation, GatherPlan, RuntimeFacts, Unsharded, plan_accumulation, plan_gather, plan_replica,
)


@dataclass(frozen=True)
class ParamFacts:
    """What the plan knows of one parameter."""

    layout: ShardLayout
    stored_dtype: str
    compute_dtype: str
    requires_grad: bool
    # The shard must be converted before it can be gathered for compute: another dtype, another device (CPU
    # offload), a tensor subclass.
    converts_for_compute: bool
    # A replica (no_shard) computes with an owned copy: another dtype or device (a tensor subclass is used as
    # it is, where gathering would have to unwrap it).
    replica_needs_copy: bool
    # Gathered alone, the way its own hooks say (torch's all-gather extensions: fsdp_pre/post_all_gather).
    travels_alone: bool = False


class GroupPlan:
    """The plan of one group: ``params`` (the runtime's, named here) described by ``facts``."""

    def __init__(self, params: Sequence[Any], facts: Sequence[ParamFacts], module_name: str, owner_kind: str,
                 reduce_dtype: Optional[str], fuse_below_numel: int, collectives: Collectives, backend: Backend,
                 runtime: RuntimeFacts = TORCH_RUNTIME) -> None:
        self.params = list(params)
        self.facts = list(facts)
        self.module_name, self.owner_kind = module_name, owner_kind  # owner_kind: "module" or "cell"
        self._reduce_dtype = reduce_dtype
        self.fuse_below_numel = fuse_below_numel  # gradients this large are reduced alone, too
        self.collectives, self.backend = collectives, backend
        self.layouts = tuple(f.layout for f in facts)
        # Only parameters of the same dtypes and trainability share a buffer; one with its own gather hooks
        # travels alone.
        kinds = tuple(("alone", i) if f.travels_alone else (f.stored_dtype, f.compute_dtype, f.requires_grad)
                      for i, f in enumerate(facts))
        self.buckets: list[BucketLayout] = plan_buckets(self.layouts, fuse_below_numel, kinds)
        # A bucket's reduction also counts which members any rank had a gradient for, where a rank may have none
        # for some (a lone member is reduced only where it has one).
        self.reduce_buckets: list[BucketLayout] = [
            b.with_presence() if runtime.grads_may_be_absent and not b.is_single else b for b in self.buckets
        ]
        self._check_dtypes_travel()
        self.gather_plans: list[GatherPlan] = [
            plan_gather(b, self.layouts, cast_needed=facts[b.members[0]].converts_for_compute,
                        exchange=collectives.gather, runtime=runtime, bit_cast=self.gather_carrier(i)[1])
            for i, b in enumerate(self.buckets)
        ]
        # no_shard: what each replica computes with (nothing is gathered)
        self.replica_plans: list[Unsharded] = [plan_replica(f.replica_needs_copy) for f in facts]
        # where each parameter's gradients are summed while gradient sync is off
        self.accumulations: list[Accumulation] = [
            plan_accumulation(f.compute_dtype == self.reduce_dtype(i), runtime) for i, f in enumerate(facts)
        ]
        self._name_buckets()

    def _check_dtypes_travel(self) -> None:
        """Every dtype must travel on this backend: refused now, naming the parameter, not in a collective."""
        for index, bucket in enumerate(self.buckets):
            first = bucket.members[0]
            try:
                self.gather_carrier(index)
                if self.facts[first].requires_grad:
                    carrier_dtype(self.backend, self.reduce_dtype(first), summed=True)
            except ValueError as error:
                fact = self.facts[first]
                raise ValueError(
                    f"fully_shard({self.module_name}): parameter '{self.params[first].fqn}' ({fact.stored_dtype}, "
                    f"computing in {fact.compute_dtype}): {error}; or set MixedPrecisionPolicy(param_dtype=..., "
                    "reduce_dtype=...)"
                ) from None

    # ------------------------------------------------------------------ dtypes
    def reduce_dtype(self, index: int) -> str:
        """What parameter ``index``'s gradients are summed in."""
        return self._reduce_dtype or self.facts[index].compute_dtype

    def gather_carrier(self, bucket: int) -> tuple[str, bool]:
        """The dtype bucket ``bucket`` travels in for its all-gather, and whether that is a bit cast."""
        dtype = self.facts[self.buckets[bucket].members[0]].compute_dtype
        carrier = carrier_dtype(self.backend, dtype, summed=self.collectives.gather is Exchange.ZERO_FILLED_ALL_REDUCE)
        return carrier, is_bit_cast(dtype, carrier)

    def wire_dtype(self, index: int, replicated: bool = False, accumulated_without_sync: bool = False) -> str:
        """The dtype parameter ``index``'s gradients travel in to be summed, the same on every rank.

        Decided from what every rank shares (dtypes, the exchange, whether sync was off), never from the
        gradients a rank happens to hold: both ends of each message must agree on its size. Pairwise, a
        gradient narrower than the reduce dtype travels as it is (``plan.exchange.wire_dtype``); replicas,
        accumulators and ring collectives sum in the reduce dtype; a backend that cannot sum that dtype
        carries it widened (``plan.exchange.carrier_dtype``).
        """
        reduce = self.reduce_dtype(index)
        wire = reduce if replicated or accumulated_without_sync else \
            wire_dtype(self.collectives.reduce, self.facts[index].compute_dtype, reduce)
        return carrier_dtype(self.backend, wire, summed=True)

    # ------------------------------------------------------------------ names
    def members(self, index: int) -> list[Any]:
        return [self.params[i] for i in self.buckets[index].members]

    def rename(self, module_fqn: str) -> None:
        """Name the parameters from the root's paths (known when the root's first forward adopts the unit)."""
        if self.module_name == module_fqn or not module_fqn:
            return
        for param in self.params:
            param.fqn = f"{module_fqn}.{param.local_fqn}"
        self.module_name = module_fqn
        self._name_buckets()

    def _name_buckets(self) -> None:
        """Labels for messages, and the point-to-point tags derived from them (the same on every rank)."""
        self.labels = [self._label(b.members) for b in self.buckets]
        self.gather_tags = [exchange_tag(label, "all_gather") for label in self.labels]
        self.reduce_tags = [exchange_tag(label, "reduce_scatter") for label in self.labels]

    def _label(self, members: tuple[int, ...]) -> str:
        names = ", ".join(self.params[i].fqn for i in members[:3])
        more = f" and {len(members) - 3} more" if len(members) > 3 else ""
        return f"[{names}{more}] of {self.owner_kind} '{self.module_name}'"
