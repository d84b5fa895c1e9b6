"""One communication group on MindSpore: the parameters of one ``fully_shard`` call (sharded or replicated),
their storage, collectives and gradients.

The lifecycle (``fullshard.core.group.Group``) decides when to gather, free, keep and reduce; this class
supplies MindSpore's operations for it:

* gathering: each bucket's unsharded tensors are storage of fullshard's own, made (empty) with the group and
  refilled by every gather, storage to storage, so the tensors autograd saved stay the same objects, and a
  node built before a gather (the root's, ``unit.py``) already holds the tensors that gather fills;
* gradients: a unit's forward shows its tensors through one differentiable gather (:class:`UnitGather`) whose
  bprop receives the gradients of all of them at once (zeros for a tensor no gradient reached on this rank:
  an MoE expert without tokens) and returns this rank's reduced chunks (:func:`reduce_in_bprop`). The
  reduction completes inside the bprop, so whatever reads the gradient after it (MindSpore adding another
  term of the same Parameter, a hook, the optimizer, ``main_grad``) reads the final value; and every rank
  reduces every bucket the node carries, in the plan's order, whichever gradients arrived.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from mindspore import Tensor, nn, ops

from fullshard.core.group import Group
from fullshard.mindspore import collectives
from fullshard.mindspore.autograd import no_grad, recording
from fullshard.mindspore.buckets import Reduction, divided, gather_bucket, member_chunk, reduce_to_chunk
from fullshard.mindspore.collectives import Kind, Owned, Comm, dtype_name, dtype_named
from fullshard.mindspore.param import ShardedParam
from fullshard.plan import MINDSPORE_RUNTIME, Unsharded
from fullshard.plan.exchange import Backend, Collectives
from fullshard.plan.group import GroupPlan, FUSE_REDUCTIONS_BELOW_BYTES, AfterBackward


@dataclass(eq=False)
class Gathered:
    """A bucket's unsharded tensors (one per member) and the owned storage behind them (none: replica views)."""

    tensors: tuple[Tensor, ...]
    storage: list[Owned] = field(default_factory=list)

    def reclaim(self) -> None:
        for owned in self.storage:
            if not owned.is_reclaimed:
                owned.reclaim()


class UnitGather(nn.Cell):
    """The all-gather of the groups one node carries, as a Cell with a custom bprop: one node per forward use.

    MindSpore runs a custom-bprop Cell's ``construct`` without recording it, so the gather itself is not
    differentiated; its outputs are the very tensors it returns (fullshard's storage, filled by the gathers).
    ``bprop`` receives the gradients of every output (zeros where none arrived) and returns one reduced
    gradient per shard, which is what ``value_and_grad`` (and every other consumer) gets for the shards.
    """

    def __init__(self, carried: Callable[[], list[Any]], on_reduced: Callable[[list[Any], int], None]) -> None:
        super().__init__()
        # Kept outside the model's tree (plain callables of the unit, weakly held), so the model owns its units.
        self._carried = carried  # the units whose tensors this node carries
        self._on_reduced = on_reduced  # told which units' gradients were reduced, and the bytes they held

    def construct(self, *shards: Tensor) -> tuple[Tensor, ...]:
        return tuple(t for unit in self._carried() for group in unit.groups for t in group.tensors())

    def bprop(self, *args: Any) -> tuple[Tensor, ...]:
        douts = args[-1]
        douts = (douts,) if isinstance(douts, Tensor) else tuple(douts)
        units = self._carried()
        grads = reduce_in_bprop([group for unit in units for group in unit.groups], douts)
        self._on_reduced(units, sum(d.nbytes for d in douts))
        return grads


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
        self.comm = comm
        # HSDP: the chunks reduced within ``comm`` are summed across the replicas of ``replica`` too, unless
        # ``all_reduce_grads`` is off: partial sums then wait, owned, for a backward with it on.
        self.replica = replica
        self.replicated = replicated  # no_shard / replicate_params: nothing to gather, gradients all-reduced
        self.plan = GroupPlan(params, [p.facts for p in params], module_name, "cell",
                              dtype_name(reduce_dtype) if reduce_dtype is not None else None, fuse_below_numel,
                              collectives_, backend, MINDSPORE_RUNTIME)
        self.params = params
        # How a node takes the shards and hands out the tensors and their gradients: bucket by bucket.
        self.in_bucket_order = [params[i] for bucket in self.plan.buckets for i in bucket.members]
        for param in params:
            param.group = self
        self.gathered: list[Gathered] = [self._empty(index) for index in range(len(self.plan.buckets))]
        # The outputs of the node that carries this group in this pass: what the cells show, so that backward
        # reaches that node's bprop (None: no recorded forward carried it since the pass began).
        self.carried_outputs: Optional[tuple[Tensor, ...]] = None
        # Gradients were returned since the last gather, so an optimizer may have stepped on them: MindSpore keeps
        # no version counter that would show the write, so a kept copy is gathered again (_shards_changed).
        self.returned_grads_since_gather = False
        self.divide_factor: Optional[float] = None  # the user's (set_gradient_divide_factor, set_reduce_op_type)
        # fully_shard's: the call's data-parallel size, the widest of its meshes (plan_mesh_groups)
        self.default_divide_factor: Optional[float] = None

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
        if self.divide_factor is not None:
            return self.divide_factor
        return self.default_divide_factor or float(self.data_parallel_size)

    @property
    def requires_grad(self) -> bool:
        """Whether any parameter wants a gradient now (``requires_grad`` may change after ``fully_shard``)."""
        return any(p.requires_grad for p in self.params)

    # ------------------------------------------------------------------ gathering (core.group.Group)
    def _empty(self, index: int) -> Gathered:
        """A bucket's tensors before any gather: fullshard's storage, reclaimed (replicas: views of themselves)."""
        if self.replicated:
            return self._replicas(index)
        storage = []
        for param in self.plan.members(index):
            storage.append(collectives.zeros(param.layout.shape, param.compute_dtype,
                                         f"unsharded parameter '{param.fqn}' of cell '{self.module_name}'", Kind.WORKING))
            storage[-1].reclaim()
        return Gathered(tuple(s.tensor for s in storage), storage)

    def materialize(self) -> None:
        """Remake fullshard's own storage after ``cell.to_empty()`` (meta-device init): what ``fully_shard`` made
        inside ``ms.DeviceCtx("meta")`` is meta too, and ``to_empty`` reaches only the cells' parameters."""
        for gathered in self.gathered:
            for owned in gathered.storage:
                owned.drop()  # meta storage cannot be resized; there is nothing in it to free
        self.gathered = [self._empty(index) for index in range(len(self.plan.buckets))]
        self.carried_outputs = None
        for param in self.params:
            param.materialize()

    def tensors(self) -> tuple[Tensor, ...]:
        """Every member's unsharded tensor, ``in_bucket_order`` (what a node returns for this group)."""
        return tuple(t for gathered in self.gathered for t in gathered.tensors)

    def _start_gather(self) -> None:
        """Gather every bucket into the storage of the tensors handed out before."""
        self.returned_grads_since_gather = False
        with no_grad():
            for index, kept in enumerate(self.gathered):
                if self.replicated:
                    self.gathered[index] = self._replicas(index)
                    continue
                fresh = gather_bucket(self.plan, index, self.comm)
                for owned, new in zip(kept.storage, fresh):
                    collectives.refill(owned, new.tensor)
                collectives.release_all(fresh)

    def _replicas(self, index: int) -> Gathered:
        """A replica is its own unsharded parameter: a view of it (borrowed), or an owned cast copy (plan_replica)."""
        tensors, storage = [], []
        for i in self.plan.buckets[index].members:
            param = self.plan.params[i]
            if self.plan.replica_plans[i] is Unsharded.OWN_STORAGE:
                storage.append(collectives.adopt(
                    param.sharded.astype(param.compute_dtype),
                    f"{dtype_name(param.compute_dtype)} copy of replica '{param.fqn}' of cell '{self.module_name}'",
                    (param.sharded,), Kind.WORKING,
                ))
                tensors.append(storage[-1].tensor)
            else:
                tensors.append(param.sharded.reshape(param.layout.shape))
        return Gathered(tuple(tensors), storage)

    def _finish_gather(self) -> None:
        """MindSpore's collectives on CPU complete when issued: nothing to wait for; the cells show the tensors."""
        self.show()

    def show(self) -> None:
        """The cells' attributes show the outputs of the node that carries this group in this pass, or else
        the gathered tensors (no gradient reaches the shards through those). In a recorded forward those are
        cut from autograd's history: they were outputs of a node of an earlier pass (a unit frozen since), and
        a backward reaching that node again would fail ("backward the graph twice")."""
        shown = self.carried_outputs
        if shown is None:
            shown = tuple(ops.stop_gradient(t) for t in self.tensors()) if recording() else self.tensors()
        for param, tensor in zip(self.in_bucket_order, shown):
            param.show(tensor)

    def _hide(self) -> None:
        for param in self.params:
            param.hide()

    def _free(self, keep_post_forward_chunks: bool) -> None:
        self._hide()
        for gathered in self.gathered:
            gathered.reclaim()

    def _keep(self) -> None:
        self._hide()

    def _keep_for_backward(self) -> None:
        """Until backward, the cells keep showing the node's outputs (as FSDP2's modules show the unsharded
        parameters): a use outside the unit's forward (a tied projection or a penalty in the loss) then
        reaches the same node, and its gradient is reduced with the rest."""

    def _shards_changed(self) -> bool:
        return self.returned_grads_since_gather

    def _abandon_gathers(self) -> None:
        self._free(keep_post_forward_chunks=False)

    # ------------------------------------------------------------------ gradients (core.group.Group)
    def has_pending_grads(self) -> bool:
        """Gradients kept for a later synced backward (accumulators, partial sums)."""
        return any(p.grad_accumulator is not None or p.partial is not None for p in self.params)

    def _start_reduce(self) -> list:
        """Reductions complete inside the bprops; what waits is a sum for a later backward, or a sum no synced
        backward reached (the unit got no gradient while sync was on): that one cannot reach the gradients
        ``value_and_grad`` returns, so it fails loudly (the same on every rank) instead of vanishing."""
        if self.reduce_grads and any(p.grad_accumulator is not None for p in self.params):
            names = [p.fqn for p in self.params if p.grad_accumulator is not None]
            raise RuntimeError(
                f"cell '{self.module_name}': gradients of {names[:3]} were accumulated with gradient sync off, "
                "but the backward with sync on did not reach them (the cell's outputs got no gradient), so their "
                "reduction has no gradient to land in; use the cell in the backward that syncs, or call "
                "set_requires_gradient_sync(True) before the last micro-batch that uses it"
            )
        return []

    def _abandon_grads(self) -> None:
        """Forget gradients kept for later (a step raised)."""
        for param in self.params:
            param.drop_grads()

    def reduce_dtype(self, param: ShardedParam) -> Any:
        """What ``param``'s gradients are summed in."""
        return dtype_named(self.plan.reduce_dtype(self.params.index(param)))

    def wire_dtype(self, param: ShardedParam) -> Any:
        """What ``param``'s gradients travel in to be summed (the same on every rank)."""
        return dtype_named(self.plan.wire_dtype(self.params.index(param), self.replicated))

    def reduction(self, param: ShardedParam) -> tuple:
        """What a gradient of ``param`` is reduced with: gradients that share it share one collective."""
        how = Reduction(self.comm, self.plan.collectives.reduce, self.wire_dtype(param), self.reduce_dtype(param),
                        self.replicated)
        return how, self.divisor, self.replica, self.all_reduce_grads


@dataclass(eq=False)
class _Request:
    """One parameter's unsharded gradient to reduce in a bprop, and its result once reduced."""

    group: ParamGroup
    param: ShardedParam
    grad: Tensor  # full shape: autograd's (borrowed while read), or an accumulated sum fullshard owns
    result: Optional[Tensor] = None


def reduce_in_bprop(groups: list[ParamGroup], douts: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    """A node's bprop: the gradients of every tensor it showed (its groups' ``in_bucket_order``) -> each shard's
    gradient, in the same order.

    Buckets in which no parameter wants a gradient return zeros; without gradient sync the gradients are summed
    for later and zeros returned. Every other bucket is reduced here, whether or not a gradient reached it on
    this rank (MindSpore hands zeros then), so every rank issues the same collectives in the same order.
    """
    requests, offset = [], 0
    for group in groups:
        for index in range(len(group.plan.buckets)):
            members = group.plan.members(index)
            grads, offset = douts[offset:offset + len(members)], offset + len(members)
            if not any(p.requires_grad for p in members):
                continue
            if not group.reduce_grads:  # sync off: sum for the backward that syncs
                for param, grad in zip(members, grads):
                    param.accumulate_grad(grad, group.wire_dtype(param))
                continue
            requests.extend(_Request(group, p, p.take_grad(g)) for p, g in zip(members, grads))
            group.returned_grads_since_gather = True
    _reduce_requests(requests)
    reduced = {id(r.param): r.result for r in requests}
    return tuple(
        reduced.get(id(param)) if reduced.get(id(param)) is not None else _zeros(param)
        for group in groups for param in group.in_bucket_order
    )


def _reduce_requests(requests: list[_Request]) -> None:
    """One collective per batch of gradients that share how they are reduced (comm, dtypes, divisor, replicas),
    in order, each batch up to ``FUSE_REDUCTIONS_BELOW_BYTES``; a gradient as large as its group's fusion
    threshold travels alone (its own bytes, zero copy where the plan allows)."""
    batches: list[tuple[tuple, list[_Request]]] = []
    open_batch: dict[tuple, list[_Request]] = {}
    for request in requests:
        key = request.group.reduction(request.param)
        if request.param.layout.padded_chunk_numel >= request.group.plan.fuse_below_numel:
            batches.append((key, [request]))
            continue
        batch = open_batch.get(key)
        if batch is None or sum(r.grad.nbytes for r in batch) >= FUSE_REDUCTIONS_BELOW_BYTES:
            batch = open_batch[key] = []
            batches.append((key, batch))
        batch.append(request)
    for key, batch in batches:
        _reduce_batch(batch, *key)


def _reduce_batch(batch: list[_Request], how: Reduction, divisor: float, replica: Optional[Comm],
                  all_reduce_grads: bool) -> None:
    params = [r.param for r in batch]
    label = _batch_label(batch)
    lenders = [collectives.borrow(r.grad, f"incoming gradient of '{r.param.fqn}'") for r in batch]
    try:
        with no_grad():
            output, bucket, offset = reduce_to_chunk(how, params, [r.grad for r in batch], label)
    finally:
        collectives.release_all(lenders)
    try:
        with no_grad():
            chunk = output.tensor.narrow(0, offset, bucket.chunk_numel)  # this rank's chunk of every member: a view
            if replica is not None:
                chunk, summed = _sum_across_replicas(params, bucket, chunk, replica, all_reduce_grads, label)
                if chunk is None:
                    return  # partial sums, kept for a later backward; zeros are returned meanwhile
                output.reclaim()
                output = summed
            _results(batch, bucket, divided(chunk, divisor), output.tensor)
    finally:
        output.reclaim()


def _results(batch: list[_Request], bucket: Any, chunk: Tensor, reduced: Tensor) -> None:
    """Each member's sharded gradient out of this rank's (divided) chunk: storage of its own, in the stored dtype,
    handed to autograd (never written by fullshard again); ``main_grad`` adds it."""
    for index, request in enumerate(batch):
        param = request.param
        local = member_chunk(chunk, bucket, index, param)
        if local is None:
            continue  # this rank holds none of it: zeros
        if param.requires_grad:
            param.add_to_main_grad(local)
        grad = sharded_copy(local, param.stored_dtype)
        collectives.check_fresh(grad, (reduced,), f"sharded gradient of '{param.fqn}'")
        request.result = grad


def sharded_copy(local: Tensor, stored_dtype: Any) -> Tensor:
    """The sharded gradient as storage of its own: a cast, or a copy (a same-dtype cast would be a view)."""
    return local.astype(stored_dtype) if local.dtype != stored_dtype else local.copy()


def _sum_across_replicas(params, bucket, chunk, replica, all_reduce_grads, label) -> tuple:
    """HSDP: this rank's chunk, plus any partial sums, summed across replicas; or kept as partial sums (None)."""
    layouts = [p.layout for p in params]
    pieces, any_partial = [], False
    for index, param in enumerate(params):
        start, end = bucket.member_span(index, layouts)
        piece = chunk.narrow(0, start, end - start)
        if param.partial is not None:
            piece, any_partial = piece + param.partial.tensor, True
        pieces.append(piece)
    if not all_reduce_grads:
        for param, piece in zip(params, pieces):
            param.keep_partial(piece)
        return None, None
    total = ops.cat(pieces) if any_partial else chunk
    summed = collectives.adopt(collectives.all_reduce(total, replica), f"replica-summed gradient of {label}", (total,))
    for param in params:
        param.drop_partial()
    return summed.tensor, summed


def _batch_label(batch: list[_Request]) -> str:
    names = [r.param.fqn for r in batch]
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    cells = ", ".join(dict.fromkeys(f"'{r.group.module_name}'" for r in batch))
    return f"[{shown}] of cell {cells}"


def _zeros(param: ShardedParam) -> Tensor:
    return ops.zeros(param.layout.local_shape(param.rank), param.stored_dtype)


def carried_by(unit: Any) -> Callable[[], list[Any]]:
    """A weak callable for a unit's node: the units it carries (``unit.carrying``)."""
    ref = weakref.ref(unit)
    return lambda: ref().carrying if ref() is not None else []
