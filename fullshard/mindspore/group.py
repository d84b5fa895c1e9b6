"""One communication group on MindSpore: the parameters of one ``fully_shard`` call (sharded or replicated),
their storage, collectives and gradients.

The lifecycle (``fullshard.core.lifecycle.Group``) decides when to gather, free, keep and reduce; this class
supplies MindSpore's operations for it:

* gathering: each bucket's unsharded tensors are storage of fullshard's own, allocated by the first gather,
  reclaimed on reshard and refilled by every later gather, storage to storage, so the tensors autograd saved
  stay the same objects; one differentiable gather per bucket (:class:`BucketGather`) hands them to the
  cells, and its bprop receives their gradients;
* gradients: a bprop returns placeholders of the shards' shapes, owned by fullshard until the reduction
  fills them (``value_and_grad`` returns the filled data); the unit reduces once its backward is done, with
  the other units in a batch (``reduce_groups``): one collective per kind of reduction instead of one per
  bucket. A bucket a forward used more than once is reduced at its last bprop instead, and returns the
  result: MindSpore sums the bprops of two uses as they come, so a placeholder filled later would be lost.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from mindspore import Tensor, nn, ops

from fullshard.core.lifecycle import Group
from fullshard.mindspore import buffers, collectives
from fullshard.mindspore.autograd import no_grad
from fullshard.mindspore.buckets import Reduction, divided, gather_bucket, member_chunk, reduce_to_chunk, sharded_grad
from fullshard.mindspore.buffers import Borrowed, Kind, Owned
from fullshard.mindspore.collectives import Comm
from fullshard.mindspore.group_plan import GroupPlan
from fullshard.mindspore.param import ShardedParam
from fullshard.mindspore.policies import dtype_name
from fullshard.plan import Unsharded
from fullshard.plan.backends import Backend, Collectives
from fullshard.plan.strategy import AfterBackward


@dataclass(eq=False)
class Gathered:
    """A bucket's unsharded tensors (one per member) and the owned storage behind them (none: the replicas)."""

    tensors: tuple[Tensor, ...]
    storage: list[Owned] = field(default_factory=list)

    def reclaim(self) -> None:
        for owned in self.storage:
            if not owned.is_reclaimed:
                owned.reclaim()


@dataclass(eq=False)
class GradEntry:
    """One parameter's gradient waiting for its reduction, and where the result goes."""

    param: ShardedParam
    grad: Tensor  # full shape: autograd's (borrowed), or a sum fullshard owns
    placeholder: Optional[Owned]  # what the bprop returned, filled by the reduction; None: the result is returned
    lenders: list[Borrowed] = field(default_factory=list)


class BucketGather(nn.Cell):
    """All-gather of one bucket as a Cell with a custom bprop.

    MindSpore runs a custom-bprop Cell's ``construct`` without recording it, so the gather itself is not
    differentiated; ``bprop`` receives the gradients of the unsharded tensors (borrowed from autograd) and
    returns one gradient per shard, which is what ``value_and_grad`` hands out for the shard Parameters.
    """

    def __init__(self, group: "ParamGroup", index: int) -> None:
        super().__init__()
        # Not a Cell attribute of the model: kept outside its tree, and weakly, so the model owns the group.
        self._group = weakref.ref(group)
        self._index = index

    def construct(self, *shards: Tensor) -> tuple[Tensor, ...]:
        return self._group().gathered[self._index].tensors

    def bprop(self, *args: Any) -> tuple[Tensor, ...]:
        douts = args[-1]
        return self._group().deliver(self._index, (douts,) if isinstance(douts, Tensor) else tuple(douts))


class ParamGroup(Group):
    def __init__(
        self,
        params: list[ShardedParam],
        comm: Comm,
        replica: Optional[Comm],
        reduce_dtype: Optional[Any],
        module_name: str,
        collectives_: Collectives,
        backend: Backend,
        fuse_below_numel: int,
        replicated: bool = False,
        after_backward: AfterBackward = AfterBackward.RESHARD,
    ) -> None:
        super().__init__(after_backward)
        self.params = params
        self.comm = comm
        # HSDP: the chunks reduced within ``comm`` are summed across the replicas of ``replica`` too, unless
        # ``all_reduce_grads`` is off: partial sums then wait, owned, for a backward with it on.
        self.replica = replica
        self.replicated = replicated  # no_shard / replicate_params: nothing to gather, gradients all-reduced
        for param in params:
            param.group = self
        self.plan = GroupPlan(params, reduce_dtype, module_name, fuse_below_numel, collectives_, backend)
        self.gathers = [BucketGather(self, index) for index in range(len(self.plan.buckets))]
        self.gathered: list[Optional[Gathered]] = [None] * len(self.plan.buckets)
        self.divide_factor: Optional[float] = None
        self._entries: list[GradEntry] = []  # delivered in this backward, waiting for the reduction
        # bucket -> (its bprops still to come in this backward, its uses by the recorded forwards)
        self._uses: dict[int, tuple[int, int]] = {}
        self.on_delivered: Optional[Callable[[], None]] = None  # the unit counts its buckets' bprops

    @property
    def module_name(self) -> str:
        return self.plan.module_name

    def rename(self, module_fqn: str) -> None:
        self.plan.rename(module_fqn)

    @property
    def data_parallel_size(self) -> int:
        return self.comm.size * (self.replica.size if self.replica is not None else 1)

    @property
    def divisor(self) -> float:
        return self.divide_factor if self.divide_factor is not None else float(self.data_parallel_size)

    # ------------------------------------------------------------------ gathering (core.lifecycle.Group)
    def _start_gather(self) -> None:
        """Gather every bucket: into the storage of the tensors handed out before, or, the first time, new."""
        with no_grad():
            for index in range(len(self.plan.buckets)):
                fresh, kept = self._gather(index), self.gathered[index]
                if kept is None or not kept.storage:  # the first gather, or replicas (nothing to refill)
                    self.gathered[index] = fresh
                    continue
                for owned, new in zip(kept.storage, fresh.storage):
                    buffers.refill(owned, new.tensor)
                fresh.reclaim()

    def _gather(self, index: int) -> Gathered:
        if not self.replicated:
            storage = gather_bucket(self.plan, index, self.comm)
            return Gathered(tuple(s.tensor for s in storage), storage)
        # A replica is its own unsharded parameter: a view of it (borrowed), or an owned cast copy (plan_replica).
        tensors, storage = [], []
        for i in self.plan.buckets[index].members:
            param = self.params[i]
            if self.plan.replica_plans[i] is Unsharded.OWN_STORAGE:
                storage.append(buffers.adopt(
                    param.sharded.astype(param.compute_dtype),
                    f"{dtype_name(param.compute_dtype)} copy of replica '{param.fqn}' of cell '{self.module_name}'",
                    (param.sharded,), Kind.WORKING,
                ))
                tensors.append(storage[-1].tensor)
            else:
                tensors.append(param.sharded.reshape(param.layout.shape))
        return Gathered(tuple(tensors), storage)

    def _finish_gather(self) -> None:
        """MindSpore's collectives on CPU complete when issued: nothing to wait for."""

    def use_in_forward(self, recording: bool) -> int:
        """Show every bucket through its differentiable gather, so a recorded forward's backward reaches the
        bprops; the number of bprops to expect."""
        expected = 0
        for index, gather in enumerate(self.gathers):
            members = self.plan.members(index)
            outputs = gather(*[p.sharded for p in members])
            for param, tensor in zip(members, (outputs,) if isinstance(outputs, Tensor) else outputs):
                param.show(tensor)
            if recording and members[0].requires_grad:
                remaining, uses = self._uses.get(index, (0, 0))
                self._uses[index] = (remaining + 1, uses + 1)  # bprops to come, and uses in all
                expected += 1
        return expected

    def show(self) -> None:
        """The cells' attributes show the unsharded tensors."""
        for index, gathered in enumerate(self.gathered):
            if gathered is not None:
                for param, tensor in zip(self.plan.members(index), gathered.tensors):
                    param.show(tensor)

    def _hide(self) -> None:
        for param in self.params:
            param.hide()

    def _free(self, keep_post_forward_chunks: bool) -> None:
        self._hide()
        for gathered in self.gathered:
            if gathered is not None:
                gathered.reclaim()

    def _keep(self) -> None:
        self._hide()

    def _keep_for_backward(self) -> None:
        self._hide()  # the cells show their shards between forward and backward; autograd holds the tensors

    def _shards_changed(self) -> bool:
        # MindSpore keeps no version counter an optimizer step moves; the lifecycle's rule gathers afresh at
        # every step but those that accumulate gradients without sync.
        return False

    def _abandon_gathers(self) -> None:
        self._free(keep_post_forward_chunks=False)
        self._uses.clear()

    # ------------------------------------------------------------------ gradients (core.lifecycle.Group)
    def deliver(self, index: int, grads: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        """Bucket ``index``'s bprop: autograd's gradients (full shape, borrowed) -> what ``value_and_grad`` is
        handed for each member's shard."""
        members = self.plan.members(index)
        if not members[0].requires_grad:
            return _zeros(members)
        try:
            return self._take(index, members, grads)
        finally:
            if self.on_delivered is not None:
                self.on_delivered()

    def _take(self, index: int, members: list[ShardedParam], grads: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        remaining, uses = self._uses.pop(index, (1, 1))
        if remaining > 1:
            self._uses[index] = (remaining - 1, uses)
        if not self.reduce_grads or remaining > 1:
            # without sync, or another bprop of this backward delivers this bucket again: sum until then
            for param, grad in zip(members, grads):
                param.accumulate_grad(grad, self.plan.wire_dtype(self.plan.reduce_dtype(param)))
            return _zeros(members)
        entries = [self._entry(p, p.take_grad(g), placeholder=uses == 1) for p, g in zip(members, grads)]
        if uses > 1:
            return reduce_now(self, entries)
        self._entries.extend(entries)
        return tuple(e.placeholder.tensor for e in entries)

    def _entry(self, param: ShardedParam, grad: Tensor, placeholder: bool) -> GradEntry:
        lenders = [buffers.borrow(grad, f"incoming gradient of '{param.fqn}'")]
        shape = param.layout.local_shape(param.rank)
        owned = buffers.zeros(shape, param.stored_dtype, f"gradient of '{param.fqn}' (filled by its reduction)") \
            if placeholder else None
        return GradEntry(param, grad, owned, lenders)

    def has_pending_grads(self) -> bool:
        """Gradients delivered in this backward, or kept for a later synced one (accumulators, partial sums)."""
        return bool(self._entries) or any(p.grad_accumulator is not None or p.partial is not None for p in self.params)

    def pending_grad_bytes(self) -> int:
        return sum(e.grad.nbytes for e in self._entries)

    def take_entries(self) -> list[GradEntry]:
        entries, self._entries = self._entries, []
        return entries

    def _start_reduce(self) -> list:
        reduce_groups([self])
        return []

    def _abandon_grads(self) -> None:
        """Forget gradients kept for later and those waiting for a reduction (a step raised)."""
        for entry in self.take_entries():
            _release(entry)
        for param in self.params:
            param.drop_grads()
        self._uses.clear()

    def reduction(self, param: ShardedParam) -> tuple:
        """What a gradient of ``param`` is reduced with: gradients that share it share one collective."""
        reduce_dtype = self.plan.reduce_dtype(param)
        how = Reduction(self.comm, self.plan.collectives.reduce, self.plan.wire_dtype(reduce_dtype), reduce_dtype,
                        self.replicated)
        return how, self.divisor, self.replica, self.all_reduce_grads


def reduce_groups(groups: list[ParamGroup]) -> None:
    """Reduce the gradients these groups' bprops delivered, and fill the placeholders: one collective for every
    gradient that shares how it is reduced (comm, dtypes, divisor, replicas), whichever unit it belongs to;
    a gradient as large as the plan's fusion threshold travels alone (its own bytes, zero copy where the plan
    allows)."""
    batches: dict[tuple, list[tuple[ParamGroup, GradEntry]]] = {}
    for group in groups:
        for entry in group.take_entries():
            alone = entry.param.layout.padded_chunk_numel >= group.plan.fuse_below_numel
            key = group.reduction(entry.param)
            batches.setdefault((id(entry) if alone else key[0].comm.group, *key), []).append((group, entry))
    try:
        while batches:
            key = next(iter(batches))
            _reduce_batch(batches.pop(key), *key[1:])
    finally:  # a reduction raised: the others' gradients are let go of, as a failed step's
        for batch in batches.values():
            for _, entry in batch:
                _release(entry)


def reduce_now(group: ParamGroup, entries: list[GradEntry]) -> tuple[Tensor, ...]:
    """A bucket reduced at its last bprop (it was used more than once): the results are returned, not filled."""
    how = group.reduction(entries[0].param)
    return _reduce_batch([(group, e) for e in entries], *how)


def _reduce_batch(batch: list[tuple[ParamGroup, GradEntry]], how: Reduction, divisor: float,
                  replica: Optional[Comm], all_reduce_grads: bool) -> tuple[Tensor, ...]:
    entries = [entry for _, entry in batch]
    params = [e.param for e in entries]
    label = _batch_label(batch)
    try:
        with no_grad():
            output, bucket, offset = reduce_to_chunk(how, params, [e.grad for e in entries], label)
    finally:
        for entry in entries:
            for lender in entry.lenders:
                lender.release()
    try:
        with no_grad():
            chunk = output.tensor.narrow(0, offset, bucket.chunk_numel)  # this rank's chunk of every member: a view
            if replica is not None:
                chunk, summed = _sum_across_replicas(entries, bucket, chunk, replica, all_reduce_grads, label)
                if chunk is None:
                    return _zeros(params)  # partial sums, kept for a later backward
                output.reclaim()
                output = summed
            return _fill(entries, bucket, divided(chunk, divisor), output.tensor)
    finally:
        output.reclaim()


def _fill(entries: list[GradEntry], bucket: Any, chunk: Tensor, reduced: Tensor) -> tuple[Tensor, ...]:
    """Each member's sharded gradient out of this rank's (divided) chunk: into its placeholder, or returned."""
    results = []
    for index, entry in enumerate(entries):
        param = entry.param
        local = member_chunk(chunk, bucket, index, param)
        if local is None:
            results.append(ops.zeros(param.layout.local_shape(param.rank), param.stored_dtype))
            if entry.placeholder is not None:
                entry.placeholder.hand_off()
            continue
        param.add_to_main_grad(local)
        if entry.placeholder is not None:
            buffers.assign(entry.placeholder, sharded_grad(local, param.stored_dtype), "fill the gradient placeholder")
            results.append(entry.placeholder.hand_off())  # the caller's gradient now: never written again
        else:  # returned as it is: out of the reduced buffer, which is freed next
            grad = sharded_copy(local, param.stored_dtype)
            buffers.check_fresh(grad, (reduced,), f"sharded gradient of '{param.fqn}'")
            results.append(grad)
    return tuple(results)


def sharded_copy(local: Tensor, stored_dtype: Any) -> Tensor:
    """The sharded gradient as storage of its own: a cast, or a copy (a same-dtype cast would be a view)."""
    return local.astype(stored_dtype) if local.dtype != stored_dtype else local.copy()


def _sum_across_replicas(entries, bucket, chunk, replica, all_reduce_grads, label) -> tuple:
    """HSDP: this rank's chunk, plus any partial sums, summed across replicas; or kept as partial sums (None)."""
    layouts = [e.param.layout for e in entries]
    pieces, any_partial = [], False
    for index, entry in enumerate(entries):
        start, end = bucket.member_span(index, layouts)
        piece = chunk.narrow(0, start, end - start)
        if entry.param.partial is not None:
            piece, any_partial = piece + entry.param.partial.tensor, True
        pieces.append(piece)
    if not all_reduce_grads:
        for entry, piece in zip(entries, pieces):
            entry.param.keep_partial(piece)
            if entry.placeholder is not None:
                entry.placeholder.hand_off()  # stays zeros: nothing is summed across replicas yet
        return None, None
    total = ops.cat(pieces) if any_partial else chunk
    summed = buffers.adopt(collectives.all_reduce(total, replica), f"replica-summed gradient of {label}", (total,))
    for entry in entries:
        entry.param.drop_partial()
    return summed.tensor, summed


def _batch_label(batch: list[tuple[ParamGroup, GradEntry]]) -> str:
    names = [e.param.fqn for _, e in batch]
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    cells = ", ".join(dict.fromkeys(f"'{g.module_name}'" for g, _ in batch))
    return f"[{shown}] of cell {cells}"


def _release(entry: GradEntry) -> None:
    for lender in entry.lenders:
        lender.release()
    if entry.placeholder is not None:
        entry.placeholder.hand_off()


def _zeros(members) -> tuple[Tensor, ...]:
    return tuple(ops.zeros(p.layout.local_shape(p.rank), p.stored_dtype) for p in members)
