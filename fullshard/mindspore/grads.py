"""The gradient side of one group: what a bucket's bprop does with the gradients autograd hands it.

On MindSpore the reduction cannot wait: ``value_and_grad`` takes each shard's
gradient from the bucket's bprop as it runs, so the bucket reduces there
(``plan.strategy``'s ``defers_reduction=False``). Autograd's gradients are
borrowed: read (summed, packed), never written or freed. Without sync they
are summed into owned accumulators and the shards get zeros; HSDP may keep
owned partial sums instead of summing across replicas.
"""
from __future__ import annotations

from typing import Optional, Sequence

from mindspore import Tensor, ops

from fullshard.mindspore import buffers
from fullshard.mindspore import exchange as transport
from fullshard.mindspore.buffers import Kind, Owned
from fullshard.mindspore.collectives import finish_grad, member_chunk, pack_grads
from fullshard.mindspore.exchange import Comm
from fullshard.mindspore.group_plan import GroupPlan
from fullshard.mindspore.param import ShardedParam
from fullshard.plan import MINDSPORE_RUNTIME, Ownership, ShardedGrad, plan_reduce


class GradReducer:
    def __init__(self, params: list[ShardedParam], comm: Comm, replica: Optional[Comm], all_reduce: bool) -> None:
        self.params = params
        self.comm = comm
        # HSDP: the chunks reduced within ``comm`` are summed across the replicas of ``replica`` too,
        # unless ``all_reduce_grads`` is off: partial sums then wait, owned, for a backward with it on.
        self.replica = replica
        # Replicated parameters (no_shard, replicate_params): whole gradients all-reduced.
        self.all_reduce = all_reduce
        self.reduce_grads = True
        self.all_reduce_grads = True
        self.divide_factor: Optional[float] = None
        self._partials: dict[int, Owned] = {}
        self.plan: GroupPlan

    @property
    def data_parallel_size(self) -> int:
        return self.comm.size * (self.replica.size if self.replica is not None else 1)

    @property
    def divisor(self) -> float:
        return self.divide_factor if self.divide_factor is not None else float(self.data_parallel_size)

    def has_pending_grads(self) -> bool:
        """Gradients kept for a later synced backward (accumulators, HSDP partial sums)."""
        return bool(self._partials) or any(p.grad_accumulator is not None for p in self.params)

    def reduce(self, index: int, grads: Sequence[Tensor]) -> tuple[Tensor, ...]:
        """Bucket ``index``'s bprop: autograd's gradients (full shape, borrowed) -> each member's sharded gradient."""
        members = self.plan.members(index)
        if not members[0].requires_grad:
            return _zeros(members)
        lent = [buffers.borrow(g, f"incoming gradient of '{p.fqn}'") for p, g in zip(members, grads)]
        try:
            if not self.reduce_grads:
                for param, grad in zip(members, grads):
                    param.accumulate_grad(grad, self.plan.wire_dtype(self.plan.reduce_dtype(param)))
                return _zeros(members)  # what value_and_grad returns for a step without sync
            return self._reduce(index, members, [p.take_grad(g) for p, g in zip(members, grads)])
        finally:
            # Always, even when the reduction raised: a stale entry would match the next
            # allocation at the same address and raise a false ownership error.
            for lender in lent:
                lender.release()

    def _reduce(self, index: int, members: list[ShardedParam], grads: list[Tensor]) -> tuple[Tensor, ...]:
        plan = self.plan
        bucket, label = plan.buckets[index], plan.labels[index]
        reduce_dtype = plan.reduce_dtype(members[0])
        wire = plan.wire_dtype(reduce_dtype)
        divisor = self.divisor
        reduction = plan_reduce(
            bucket, plan.layouts,
            grad_dtype_is_wire_dtype=all(g.dtype == wire for g in grads),
            grads_contiguous=all(g.is_contiguous() for g in grads),
            reduce_dtype_is_param_dtype=reduce_dtype == members[0].stored_dtype,
            all_reduce=self.all_reduce, exchange=plan.collectives.reduce, runtime=MINDSPORE_RUNTIME,
            divides=divisor != 1,
        )
        if reduction.input is Ownership.BORROWED:
            source = buffers.borrow(grads[0].reshape(-1), f"reduce-scatter input of {label}")
        else:
            source = buffers.adopt(pack_grads(bucket, members, grads, wire), f"reduce-scatter input of {label}", grads)
        read = (*grads, source.tensor)  # what this rank's reduction read: the sum must be storage of its own
        try:
            if self.all_reduce:
                summed, offset = transport.all_reduce(source.tensor, self.comm), 0
            else:
                summed, offset = transport.reduce_scatter(plan.collectives.reduce, source.tensor, self.comm)
        finally:
            buffers.release_all([source])
        output = buffers.adopt(summed, f"reduced gradient of {label}", read)
        if self.replica is not None:
            output, offset = self._sum_across_replicas(index, output, offset)
            if output is None:
                return _zeros(members)  # a partial sum, kept for a later backward
        hands_off = reduction.sharded_grad is ShardedGrad.VIEW_OF_OUTPUT and divisor == 1
        try:
            results = []
            for i, param in enumerate(members):
                grad, reduced = finish_grad(member_chunk(output.tensor, offset, bucket, i, param), reduction, divisor,
                                            param.stored_dtype)
                if not hands_off:  # the reduced buffer is freed below: the gradient must not live in it
                    buffers.check_fresh(grad, (output.tensor,), f"sharded gradient of '{param.fqn}' ({label})")
                param.add_to_main_grad(reduced)
                results.append(grad)
        except BaseException:
            output.reclaim()
            raise
        if hands_off:
            output.hand_off()  # the sharded gradients are views of it now; never freed by fullshard
        else:
            output.reclaim()
        return tuple(results)

    def _sum_across_replicas(self, index: int, output: Owned, offset: int) -> tuple[Optional[Owned], int]:
        """HSDP: this rank's chunk, plus any partial sum, summed across replicas (or kept as a partial sum)."""
        bucket, label = self.plan.buckets[index], self.plan.labels[index]
        mine = output.tensor.narrow(0, offset, bucket.chunk_numel)  # a view (slicing would copy)
        partial = self._partials.pop(index, None)
        if partial is not None:
            buffers.accumulate(partial, mine, "add to the partial gradient sum")
        else:
            partial = buffers.adopt(mine.copy(), f"partial gradient sum of {label}", (output.tensor,))
        output.reclaim()
        if not self.all_reduce_grads:
            partial.retag(Kind.MAIN_GRAD)  # kept across backward passes: gradient memory, not a transfer's
            self._partials[index] = partial
            return None, 0
        try:
            summed = buffers.adopt(transport.all_reduce(partial.tensor, self.replica),
                                   f"replica-summed gradient of {label}", (partial.tensor,))
        finally:
            partial.reclaim()
        return summed, 0

    def abandon_step(self) -> None:
        """Forget gradients kept for later (a step raised): accumulators and HSDP partial sums."""
        for param in self.params:
            param.drop_grads()
        for partial in self._partials.values():
            partial.reclaim()
        self._partials.clear()


def _zeros(members: Sequence[ShardedParam]) -> tuple[Tensor, ...]:
    return tuple(ops.zeros(p.layout.local_shape(p.rank), p.stored_dtype) for p in members)
