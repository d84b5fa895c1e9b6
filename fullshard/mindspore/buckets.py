"""All-gather of one bucket, and reduction of a batch of gradients, carrying out the ownership plan.

No layout arithmetic lives here: offsets and lengths come from
``fullshard.plan``. Every tensor fullshard reads from someone else (a shard,
a gradient autograd hands over) is registered as borrowed while it is read,
so in debug mode an "allocating" op that returned its storage instead (the
seed's same-dtype cast) fails the moment it is adopted, naming the buffer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

from mindspore import Tensor, mint, ops

from fullshard.mindspore import collectives
from fullshard.mindspore.collectives import Borrowed, Kind, Owned, Comm, dtype_name, dtype_named
from fullshard.mindspore.param import ShardedParam
from fullshard.plan import (
    MINDSPORE_RUNTIME, BucketLayout, Exchange, Ownership, ReduceFacts, Unsharded, plan_buckets, plan_reduce,
)
from fullshard.plan.group import GroupPlan, fused_bucket
from fullshard.plan.exchange import Backend, carrier_dtype, is_bit_cast


def _padded(x: Optional[Tensor], param: ShardedParam, length: int, dtype: Any) -> Tensor:
    """``x`` (``length`` long on the shard dim; None when 0) grown to the padded chunk with zeros; as is
    without padding."""
    layout = param.layout
    missing = layout.chunk - length
    if not missing:
        return x
    pad_shape = layout.shape[: layout.dim] + (missing,) + layout.shape[layout.dim + 1 :]
    zeros = ops.zeros(pad_shape, dtype)
    return mint.cat([x, zeros], layout.dim) if length else zeros


def pack_shards(bucket: BucketLayout, params: Sequence[ShardedParam], dtype: Any) -> Tensor:
    """This rank's padded chunk of every member, back to back, in ``dtype``: always new storage."""
    parts = []
    for param in params:
        shard = param.sharded
        x = shard.astype(dtype) if shard.dtype != dtype else shard
        length = param.layout.local_length(param.rank)
        parts.append(_padded(x if length else None, param, length, dtype).reshape(-1))
    return mint.cat(parts)  # allocates, even for one part


def _chunk_of(flat: Tensor, start: int, param: ShardedParam, length: int) -> Tensor:
    """The ``length`` rows (on the shard dim) of a padded chunk starting at ``start`` of a flat buffer: a view.

    ``narrow``, not ``flat[a:b]``: in PyNative a slice index copies the slice (a small-GPT block's buckets
    unpack in about half the time this way: ``benchmarks/mindspore_unpack.py``, docs/performance.md).
    """
    layout = param.layout
    chunk = flat.narrow(0, start, layout.padded_chunk_numel).reshape(layout.padded_chunk_shape)
    return chunk if length == layout.chunk else chunk.narrow(layout.dim, 0, length)


def unpack_member(flat: Tensor, bucket: BucketLayout, index: int, param: ShardedParam) -> Tensor:
    """Member ``index``'s full tensor out of a flat rank-major all-gather output, padding dropped: new storage
    (``mint.cat`` allocates even for one piece)."""
    layout = param.layout
    pieces = [_chunk_of(flat, rank * bucket.chunk_numel + bucket.offsets[index], param, layout.local_length(rank))
              for rank in range(bucket.world) if layout.local_length(rank)]
    return mint.cat(pieces, layout.dim)


def _to_carrier(source: Tensor, carrier: Any, bit_cast: bool, transient: list, label: str) -> Tensor:
    if bit_cast:
        return source.view(carrier)  # the same bytes (bf16 as fp16 bits)
    if source.dtype != carrier:
        transient.append(collectives.adopt(source.astype(carrier), f"widened all-gather input of {label}", (source,)))
        return transient[-1].tensor
    return source


def _from_carrier(flat: Tensor, dtype: Any, bit_cast: bool, transient: list, label: str, sent: Tensor) -> Tensor:
    if bit_cast:
        return flat.view(dtype)
    if flat.dtype != dtype:
        transient.append(collectives.adopt(flat, f"widened all-gather output of {label}", (sent,)))
        return flat.astype(dtype)
    return flat


def gather_bucket(plan: GroupPlan, index: int, comm: Comm) -> list[Owned]:
    """All-gather one bucket; each member's unsharded tensor, in the compute dtype, as owned storage.

    A lone dim-0 shard without padding gathers straight into the parameter's shape: the output is the
    unsharded parameter (``Unsharded.OUTPUT``). The others travel as flat padded chunks and are copied
    out of the output into tensors of their own (never views: ``RuntimeFacts.reclaims_views``).
    """
    bucket, gather, members = plan.buckets[index], plan.gather_plans[index], plan.members(index)
    label = plan.labels[index]
    dtype = members[0].compute_dtype
    carrier, bit_cast = plan.gather_carrier(index)
    carrier = dtype_named(carrier)
    whole = gather.unsharded is Unsharded.OUTPUT
    shards = [p.sharded for p in members]
    lent = [collectives.borrow(p.sharded, f"sharded parameter '{p.fqn}'") for p in members]
    transient: list[Optional[Owned | Borrowed]] = []
    try:
        if gather.input is Ownership.BORROWED:
            shard = members[0].sharded
            transient.append(collectives.borrow(shard if whole else shard.reshape(-1), f"all-gather input of {label}"))
        elif whole:  # lone, unpadded: only a cast, which allocates
            transient.append(collectives.adopt(members[0].sharded.astype(dtype), f"all-gather input of {label}", shards))
        else:
            transient.append(collectives.adopt(pack_shards(bucket, members, dtype), f"all-gather input of {label}", shards))
        source = _to_carrier(transient[-1].tensor, carrier, bit_cast, transient, label)
        flat = collectives.all_gather(plan.collectives.gather, source, comm, label)
        read = (source, *shards)  # what this rank's gather read: its output must be storage of its own
        if whole:
            param = members[0]
            if flat.dtype != dtype:  # widened on the wire: narrowing back allocates the parameter's own tensor
                transient.append(collectives.adopt(flat, f"widened all-gather output of {label}", read))
                flat = flat.astype(dtype)
            return [collectives.adopt(flat, f"unsharded parameter '{param.fqn}' of cell '{plan.module_name}'", read,
                                  Kind.WORKING)]
        flat = _from_carrier(flat, dtype, bit_cast, transient, label, source)
        transient.append(collectives.adopt(flat, f"all-gather output of {label}", read))
        return [
            collectives.adopt(unpack_member(flat, bucket, i, p), f"unsharded parameter '{p.fqn}' of cell '{plan.module_name}'",
                          (flat, *read), Kind.WORKING)
            for i, p in enumerate(members)
        ]
    finally:
        for lender in lent:
            lender.release()
        collectives.release_all(transient)


def gather_full(param: ShardedParam, comm: Comm, exchange: Exchange, backend: Backend) -> Tensor:
    """The whole parameter in its stored dtype, gathered from the shards (new storage; no autograd)."""
    if param.replicated:
        return param.sharded.copy()
    bucket = plan_buckets([param.layout], 0)[0]
    label = f"'{param.fqn}' (full state dict)"
    dtype = dtype_name(param.stored_dtype)
    carrier = carrier_dtype(backend, dtype, summed=exchange is Exchange.ZERO_FILLED_ALL_REDUCE)
    bit_cast = is_bit_cast(dtype, carrier)
    transient: list = []
    lent = collectives.borrow(param.sharded, f"sharded parameter '{param.fqn}'")
    try:
        transient.append(collectives.adopt(pack_shards(bucket, [param], param.stored_dtype), f"all-gather input of {label}",
                                       (param.sharded,)))
        source = _to_carrier(transient[-1].tensor, dtype_named(carrier), bit_cast, transient, label)
        flat = _from_carrier(collectives.all_gather(exchange, source, comm, label), param.stored_dtype, bit_cast,
                             transient, label, source)
        transient.append(collectives.adopt(flat, f"all-gather output of {label}", (source, param.sharded)))
        full = unpack_member(flat, bucket, 0, param)
        collectives.check_fresh(full, (flat,), f"full '{param.fqn}' (copied out of the all-gather output, freed next)")
        return full
    finally:
        lent.release()
        collectives.release_all(transient)


def pack_grads(bucket: BucketLayout, params: Sequence[ShardedParam], grads: Sequence[Tensor], dtype: Any) -> Tensor:
    """The reduction's input: every rank's padded chunk of every member's gradient, rank-major, in ``dtype``.

    Always new storage (casts, padding and ``mint.cat`` allocate). Row blocks (``BucketLayout.row_blocks``:
    no padding, sharded on the leading dim) take one reshape per member and one concatenation.
    """
    grads = [g.astype(dtype) if g.dtype != dtype else g for g in grads]
    if bucket.row_blocks:
        return mint.cat([g.reshape(bucket.world, -1) for g in grads], 1).reshape(-1)
    rows = []
    for rank in range(bucket.world):
        for param, grad in zip(params, grads):
            layout = param.layout
            length = layout.local_length(rank)
            piece = grad.narrow(layout.dim, layout.local_offset(rank), length) if length else None
            rows.append(_padded(piece, param, length, dtype).reshape(-1))
    return mint.cat(rows)


def member_chunk(chunk: Tensor, bucket: BucketLayout, index: int, param: ShardedParam) -> Optional[Tensor]:
    """This rank's local part of member ``index``, read out of this rank's chunk of the reduced buffer (a view);
    None where the rank holds none of it (narrow refuses a length of 0)."""
    length = param.layout.local_length(param.rank)
    return _chunk_of(chunk, bucket.offsets[index], param, length) if length else None


@dataclass(frozen=True)
class Reduction:
    """What the gradients reduced in one collective share."""

    comm: Comm
    exchange: Exchange
    wire_dtype: Any  # what they are summed in on the wire
    reduce_dtype: Any
    replicated: bool  # whole gradients all-reduced (no_shard), not reduce-scattered


def reduce_to_chunk(how: Reduction, params: Sequence[ShardedParam], grads: Sequence[Tensor], label: str
                    ) -> tuple[Owned, BucketLayout, int]:
    """Sum ``grads`` (full shapes) over the group in one collective; the owned result, the layout the members
    were packed in, and where this rank's chunk starts in the result.

    The input is the lone gradient itself where the plan borrows it (one member, already the wire's bytes),
    otherwise packed into owned storage; either way it is only read, then let go of.
    """
    layouts = tuple(p.layout for p in params)
    bucket = fused_bucket(layouts)
    # (the sharded gradient is always copied out of the result, which is freed next)
    reduction = plan_reduce(bucket, layouts, ReduceFacts(
        grad_dtype_is_wire_dtype=all(g.dtype == how.wire_dtype for g in grads),
        grads_contiguous=all(g.is_contiguous() for g in grads), reduce_dtype_is_param_dtype=False,
        all_reduce=how.replicated, exchange=how.exchange,
    ), MINDSPORE_RUNTIME)
    if reduction.input is Ownership.BORROWED:
        source = collectives.borrow(grads[0].reshape(-1), f"reduce-scatter input of {label}")
    else:
        source = collectives.adopt(pack_grads(bucket, params, grads, how.wire_dtype), f"reduce-scatter input of {label}",
                               grads)
    read = (*grads, source.tensor)  # what this rank's reduction read: the sum must be storage of its own
    try:
        if how.replicated:
            summed, offset = collectives.all_reduce(source.tensor, how.comm), 0
        else:
            summed, offset = collectives.reduce_scatter(how.exchange, source.tensor, how.comm)
    finally:
        collectives.release_all([source])
    return collectives.adopt(summed, f"reduced gradient of {label}", read), bucket, offset


def divided(chunk: Tensor, divide_factor: float) -> Tensor:
    """This rank's chunk of the reduced sum, divided out of place (in-place division is a no-op on CPU)."""
    return chunk / divide_factor if divide_factor != 1 else chunk

