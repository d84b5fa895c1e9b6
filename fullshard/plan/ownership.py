"""Who owns each communication buffer, decided from the code path alone.

The seed of this project was a real FSDP that freed a gradient it did not own:
a same-dtype "cast" returned the caller's storage and the module later resized
it to 0. Here the decision "owned or borrowed" is made once, by these pure
functions, from facts about the path (is a cast needed? padding? several
parameters in one buffer?), never by comparing pointers at run time.

Rules the runtime follows (``fullshard.buffers`` enforces them in debug mode):

* OWNED storage was allocated by fullshard (``empty``, a cast to another dtype,
  a concatenation, padding). Only owned storage may be resized or written in place.
* BORROWED storage belongs to someone else (the caller's gradient, the sharded
  parameter's own storage). It is released only by dropping the reference.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

from fullshard.plan.exchange import Exchange
from fullshard.plan.layout import BucketLayout, ShardLayout


class Ownership(enum.Enum):
    OWNED = "owned"
    BORROWED = "borrowed"


class Unsharded(enum.Enum):
    """Where an unsharded parameter's storage comes from after an all-gather."""

    VIEW_OF_OUTPUT = "view of the all-gather output (no copy)"
    OWN_STORAGE = "own storage, filled by a copy out of the all-gather output"


class ShardedGrad(enum.Enum):
    """How a reduced gradient becomes the sharded parameter's ``.grad``."""

    VIEW_OF_OUTPUT = "view of the reduce-scatter output (no copy)"
    COPY = "copy (cast or re-layout) of the reduce-scatter output"


@dataclass(frozen=True)
class GatherPlan:
    input: Ownership
    output: Ownership
    unsharded: Unsharded
    # An owned input is packed straight into this rank's chunk of the output
    # (pairwise exchange sends from there): no separate input buffer.
    packs_into_output: bool = False

    @property
    def copies_in(self) -> bool:
        return self.input is Ownership.OWNED

    @property
    def copies_out(self) -> bool:
        return self.unsharded is Unsharded.OWN_STORAGE


@dataclass(frozen=True)
class ReducePlan:
    input: Ownership
    output: Ownership
    sharded_grad: ShardedGrad

    @property
    def copies_in(self) -> bool:
        return self.input is Ownership.OWNED


def stores_padded_chunk(layout: ShardLayout) -> bool:
    """Whether the sharded parameter's storage is its whole padded chunk.

    For prefix layouts the local shard is a prefix of a padded-chunk storage,
    so the collective can read that storage directly. For other layouts with
    padding the local shard is kept contiguous (what optimizers and
    checkpoints expect), and the padded chunk must be built by a copy.
    """
    return layout.gather_is_prefix or not layout.needs_padding


def plan_gather(
    bucket: BucketLayout, layouts: tuple[ShardLayout, ...], cast_needed: bool,
    exchange: Exchange = Exchange.COLLECTIVE,
) -> GatherPlan:
    """All-gather of one bucket.

    The input is borrowed (the parameter's own padded storage, read-only)
    when one parameter travels alone as stored; any conversion (``cast_needed``:
    another dtype, or another device when the shards are offloaded) or fusion
    needs an owned input: with the pairwise or local exchange that is this
    rank's chunk of the output itself, otherwise a buffer of its own. The output is always
    allocated by fullshard. A lone parameter with a prefix layout is used as a
    view of that output; everything else is copied out of it into storage of
    its own.
    """
    lone = bucket.is_single
    layout = layouts[bucket.members[0]]
    borrow_input = lone and not cast_needed and stores_padded_chunk(layout)
    view_output = lone and layout.gather_is_prefix
    return GatherPlan(
        input=Ownership.BORROWED if borrow_input else Ownership.OWNED,
        output=Ownership.OWNED,
        unsharded=Unsharded.VIEW_OF_OUTPUT if view_output else Unsharded.OWN_STORAGE,
        packs_into_output=not borrow_input and exchange in (Exchange.PAIRWISE, Exchange.LOCAL),
    )


def plan_reduce(
    bucket: BucketLayout,
    layouts: tuple[ShardLayout, ...],
    grad_dtype_is_wire_dtype: bool,
    grads_contiguous: bool,
    reduce_dtype_is_param_dtype: bool,
    all_reduce: bool = False,
    offloaded: bool = False,
) -> ReducePlan:
    """Reduce-scatter of one bucket.

    The caller's gradient is reused as the collective's input (zero copy) only
    when it already is, byte for byte, the input the collective needs: one
    parameter, prefix layout, no padding, the dtype it travels in (the reduce
    dtype, or its own with the pairwise exchange; ``plan.exchange.wire_dtype``),
    contiguous. In that
    case it is BORROWED: fullshard never resizes it nor writes into it, and
    releases it by dropping the reference. Otherwise fullshard allocates the
    input and copies (casting, padding) into it.

    The output is allocated by fullshard; the gradient division is done in
    place on it (it is owned), then it is handed to the sharded ``.grad`` and
    never freed by fullshard again.

    An all-reduce (replicated parameters) works in place on its buffer, so its
    input is always owned: the caller's gradient is never written.

    With offloaded shards the sharded gradient is a copy on the storage device.
    """
    if all_reduce:
        view_grad = reduce_dtype_is_param_dtype and not offloaded
        return ReducePlan(
            input=Ownership.OWNED,
            output=Ownership.OWNED,
            sharded_grad=ShardedGrad.VIEW_OF_OUTPUT if view_grad else ShardedGrad.COPY,
        )
    lone = bucket.is_single
    layout = layouts[bucket.members[0]]
    borrow = (
        lone
        and layout.gather_is_prefix
        and not layout.needs_padding
        and grad_dtype_is_wire_dtype
        and grads_contiguous
    )
    view_grad = (
        reduce_dtype_is_param_dtype and not offloaded and all(layouts[i].gather_is_prefix for i in bucket.members)
    )
    return ReducePlan(
        input=Ownership.BORROWED if borrow else Ownership.OWNED,
        output=Ownership.OWNED,
        sharded_grad=ShardedGrad.VIEW_OF_OUTPUT if view_grad else ShardedGrad.COPY,
    )


def grad_copy_may_be_async(pinned: bool, accumulates: bool) -> bool:
    """Whether a reduced gradient may be copied to pinned host memory without blocking (CPU offload).

    The copy completes later, on the device's stream; only the end of backward
    waits for it. A copy that is summed into an existing gradient right away
    (accumulation across backward passes) must have landed first, so it blocks.
    """
    return pinned and not accumulates
