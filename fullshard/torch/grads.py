"""The gradient side of one group: gradients as autograd delivers them, their reduction, HSDP partial sums.

When to reduce is the unit's business (``state.py``: after the unit's
backward, as autograd vouches, or at the root's end of backward); this side
only knows how: which gradients are pending, how they travel (the plan), and
what becomes of the reduced ones.
"""
from __future__ import annotations

import functools
from typing import Callable, Optional

import torch
import torch.distributed as dist

from fullshard.plan import Accumulation, plan_reduce
from fullshard.torch import checks
from fullshard.torch.buffers import Kind, Owned
from fullshard.torch.collectives import PendingReduce, all_reduce_in_place, reduce_bucket
from fullshard.torch.group_plan import GroupPlan
from fullshard.torch.param import ShardedParam, is_plain


class GradReducer:
    def __init__(
        self,
        params: list[ShardedParam],
        process_group: dist.ProcessGroup,
        world: int,
        all_reduce: bool,
        replicate_group: Optional[dist.ProcessGroup] = None,
    ) -> None:
        self.params = params
        self.process_group = process_group
        self.world = world
        # Replicated parameters (no_shard): gradients all-reduced instead of reduce-scattered.
        self.all_reduce = all_reduce
        # HSDP: shards are reduce-scattered within process_group, then summed
        # across the replicas of replicate_group (unless all_reduce_grads is off,
        # when the partial sums wait in owned buffers for the final micro-batch).
        self.replicate_group = replicate_group
        self.replicas = dist.get_world_size(replicate_group) if replicate_group is not None else 1
        self.all_reduce_grads = True
        self._partials: dict[int, Owned] = {}
        self._reduce_grads = True
        # Whether gradient sync was off at some point since the last reduction
        # (set_requires_gradient_sync / no_sync, called alike on every rank):
        # gradients may then be fp32 accumulators, and must travel as such.
        self.accumulated_without_sync = False
        self.divide_factor: Optional[float] = None
        # FSDPModule controls: see set_reduce_scatter_unused_params, set_all_reduce_hook.
        self.reduce_unused_params = False
        self.all_reduce_hook: Optional[Callable[[torch.Tensor], None]] = None
        self.all_reduce_hook_stream = None  # where the hook runs (None: the current stream)
        # Called after every accumulated gradient (the unit makes sure its root's end of backward will come).
        self.on_grad: Optional[Callable[[], None]] = None
        self.plan: GroupPlan

    @property
    def reduce_grads(self) -> bool:
        return self._reduce_grads

    @reduce_grads.setter
    def reduce_grads(self, value: bool) -> None:
        self._reduce_grads = value
        if not value:
            self.accumulated_without_sync = True

    def on_grad_accumulated(self, index: int) -> None:
        """Autograd summed a gradient into an unsharded parameter."""
        param = self.params[index]
        if checks.check_finite_enabled():
            checks.inspect(param.fqn, param.local_grad(param.unsharded.grad))
        if not self.reduce_grads and self.plan.accumulations[index] is Accumulation.OWNED:
            # Accumulating without sync: sum in the reduce dtype (e.g. fp32 for bf16 compute).
            param.accumulate_grad_in(self.plan.reduce_dtype(param), f"gradient accumulator of '{param.fqn}'")
        if self.on_grad is not None:
            self.on_grad()

    def has_pending_grads(self) -> bool:
        """Some gradient arrived since the last reduction (read off the parameters, not tracked)."""
        return any(p.has_unreduced_grad() for p in self.params if p.requires_grad)

    def reduce(self) -> list[PendingReduce]:
        """Start reductions of the pending unsharded gradients; buckets without any are skipped."""
        pending = []
        plan = self.plan
        divide = self.divide_factor if self.divide_factor is not None else self.world * self.replicas
        for index, bucket in enumerate(plan.buckets):
            members = plan.members(index)
            if not members[0].requires_grad:
                continue
            grads = [p.take_unsharded_grad() for p in members]
            if self.reduce_unused_params:
                # Every rank reduces every bucket, a zero standing in for a gradient this rank lacks.
                grads = [g if g is not None else torch.zeros(p.layout.shape, dtype=p.compute_dtype, device=p.device)
                         for p, g in zip(members, grads)]
            if all(g is None for g in grads):
                continue
            present = [g for g in grads if g is not None]
            reduce_dtype = plan.reduce_dtype(members[0])
            wire = plan.gradient_wire_dtype(members[0].compute_dtype, reduce_dtype, self.all_reduce,
                                            self.accumulated_without_sync)
            reduction_plan = plan_reduce(
                bucket,
                plan.layouts,
                grad_dtype_is_wire_dtype=all(g.dtype == wire for g in present),
                # only a plain, contiguous gradient is a collective's buffer as it is (a subclass is packed)
                grads_contiguous=all(is_plain(g) and g.is_contiguous() for g in present),
                reduce_dtype_is_param_dtype=reduce_dtype == members[0].stored_dtype,
                all_reduce=self.all_reduce,
                offloaded=members[0].offloaded,
                exchange=plan.reduce_exchange,
            )
            reduction = reduce_bucket(
                bucket, reduction_plan, members, grads, reduce_dtype, wire, self.process_group, divide,
                plan.labels[index], plan.reduce_exchange, plan.reduce_tags[index], all_reduce=self.all_reduce,
                comm=plan.custom_reduce_scatter,
            )
            reduction.hook, reduction.hook_stream = self.all_reduce_hook, self.all_reduce_hook_stream
            if self.replicate_group is not None:
                reduction.combine = functools.partial(self._sum_across_replicas, index)
            pending.append(reduction)
        self.accumulated_without_sync = False
        return pending

    def _sum_across_replicas(self, index: int, output: Owned) -> bool:
        """HSDP: add any partial sum, then all-reduce across replicas or keep it for later."""
        partial = self._partials.pop(index, None)
        if partial is not None:
            with torch.no_grad():
                output.writable("add the partial gradient sum").add_(partial.tensor)
            partial.reclaim()
        if not self.all_reduce_grads:
            output.retag(Kind.MAIN_GRAD)  # kept across backward passes: gradient memory, not a transfer's
            self._partials[index] = output
            return False
        if self.replicas > 1:
            all_reduce_in_place(output, self.replicate_group)
        return True

    def abandon_step(self) -> None:
        """Forget this step's gradients (it raised): unreduced and reduced ones, HSDP partial sums.
        As in FSDP2, an accumulation in progress is lost with them."""
        for param in self.params:
            param.drop_grads()
        for partial in self._partials.values():
            partial.reclaim()
        self._partials.clear()
        self.accumulated_without_sync = not self.reduce_grads
