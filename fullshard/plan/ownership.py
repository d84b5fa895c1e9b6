"""Who owns each communication buffer, decided from the code path alone.

The seed of this project was a real FSDP that freed a gradient it did not own:
a same-dtype "cast" returned the caller's storage and the module later resized
it to 0. Here the decision "owned or borrowed" is made once, by these pure
functions, from facts about the path (is a cast needed? padding? several
parameters in one buffer?), never by comparing pointers at run time.

Rules the runtime follows (``fullshard.core.buffers`` enforces them under FULLSHARD_CHECK_OWNERSHIP=1):

* OWNED storage was allocated by fullshard (``empty``, a cast to another dtype,
  a concatenation, padding). Only owned storage may be resized or written in place.
* BORROWED storage belongs to someone else (the caller's gradient, the sharded
  parameter's own storage). It is released only by dropping the reference.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fullshard.plan.exchange import Exchange

if TYPE_CHECKING:  # the layouts are only read here; plan.group asks this module
    from fullshard.plan.group import BucketLayout, ShardLayout


class Ownership(enum.Enum):
    OWNED = "owned"
    BORROWED = "borrowed"


class Unsharded(enum.Enum):
    """Where an unsharded parameter's storage comes from after an all-gather."""

    VIEW_OF_OUTPUT = "view of the all-gather output (no copy)"
    OWN_STORAGE = "own storage, filled by a copy out of the all-gather output"
    # The collective gathered straight into the parameter's shape (along dim 0): its output is the
    # unsharded parameter, with no view in between (no copy either).
    OUTPUT = "the all-gather output itself"
    # no_shard: nothing is gathered; the replica, which fullshard only borrows, is the unsharded parameter.
    REPLICA = "the replica itself (borrowed: never freed or written)"


class Accumulation(enum.Enum):
    """Where gradients of backward passes without sync are summed until the synced one reduces them."""

    # autograd sums into the unsharded parameter's .grad, which fullshard only borrows (and reduces later)
    IN_AUTOGRAD = "summed by autograd into the gradient it holds"
    # the first gradient is converted into a new tensor in the reduce dtype, which becomes the unsharded parameter's
    # .grad and the dtype autograd casts the next ones to before summing them into it (torch 2.15's grad_dtype); the
    # new tensor is given away (autograd's and the user's from then on, borrowed like IN_AUTOGRAD's)
    CONVERTED_IN_AUTOGRAD = "converted once to the reduce dtype as the gradient autograd holds, then summed into it"
    OWNED = "summed into an accumulator fullshard owns, in the reduce dtype"


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
    # The output comes from a custom collective's allocator (Exchange.CUSTOM): written by
    # fullshard, released by dropping it, never resized.
    output_pooled: bool = False

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
    # The input comes from a custom collective's allocator (Exchange.CUSTOM): packed by
    # fullshard, released by dropping it, never resized.
    input_pooled: bool = False

    @property
    def copies_in(self) -> bool:
        return self.input is Ownership.OWNED


@dataclass(frozen=True)
class RuntimeFacts:
    """What a framework runtime's tensors and collectives do, as far as ownership depends on it.

    The defaults are torch's; :data:`MINDSPORE_RUNTIME` lists where MindSpore (2.10, PyNative)
    differs. The runtimes pass their row; nothing here is probed at run time.
    """

    # The sharded parameter's storage is its whole padded chunk, the local shard a prefix view of
    # it, where the layout allows (``stores_padded_chunk``). MindSpore: a shard is a Parameter of
    # its own, exactly its local shape, with nothing behind it.
    shard_in_padded_chunk: bool = True
    # Collectives write into buffers the runtime gives them (an all-reduce into its input).
    # MindSpore's collectives return new storage and only read their input.
    collectives_in_place: bool = True
    # Tensors can be scaled in place. On MindSpore 2.10's CPU kernels ``mul_``/``div_`` silently
    # return a new tensor, so a division produces the sharded gradient as new storage.
    in_place_arithmetic: bool = True
    # Resizing a view's storage to 0 frees the memory autograd saved through the view. On MindSpore
    # it does not: a view handed to autograd keeps its data alive whatever is resized (measured:
    # backward still reads the values), so storage that is to be reclaimed after forward must be
    # handed out as a tensor of its own, never as a view. MindSpore's collectives gather along dim 0,
    # so a lone dim-0 shard without padding gathers straight into the parameter's shape.
    reclaims_views: bool = True
    # A parameter's gradient of a later backward is summed into the one it holds (torch's .grad). MindSpore's
    # value_and_grad returns new gradients each call; whatever is kept between calls, fullshard keeps.
    autograd_accumulates: bool = True
    # A parameter may hold a gradient of another dtype than its own, which autograd casts later gradients to and
    # sums into (torch 2.15's ``Tensor.grad_dtype``; the torch runtime passes its installed version's row:
    # ``fullshard.torch.policies.TORCH_RUNTIME_FACTS``). Older torch refuses such a ``.grad``.
    grads_in_any_dtype: bool = False
    # A parameter a backward did not reach has no gradient at all (torch: .grad stays None, which optimizers
    # skip). MindSpore hands zeros for it instead, as a single process would.
    grads_may_be_absent: bool = True


TORCH_RUNTIME = RuntimeFacts()
MINDSPORE_RUNTIME = RuntimeFacts(
    shard_in_padded_chunk=False, collectives_in_place=False, in_place_arithmetic=False, reclaims_views=False,
    autograd_accumulates=False, grads_may_be_absent=False,
)


def stores_padded_chunk(layout: ShardLayout) -> bool:
    """Whether the sharded parameter's storage is its whole padded chunk.

    For prefix layouts the local shard is a prefix of a padded-chunk storage,
    so the collective can read that storage directly. For other layouts with
    padding the local shard is kept contiguous (what optimizers and
    checkpoints expect), and the padded chunk must be built by a copy.
    """
    return layout.gather_is_prefix or not layout.needs_padding


def shard_is_padded_chunk(layout: ShardLayout, runtime: RuntimeFacts = TORCH_RUNTIME) -> bool:
    """Whether a collective can read the sharded parameter's own storage as its padded chunk.

    On torch, whenever that storage is the padded chunk (:func:`stores_padded_chunk`); on a runtime
    that keeps nothing behind the shard, only when no padding is needed: the local shard then has
    the padded chunk's shape, contiguous.
    """
    if runtime.shard_in_padded_chunk:
        return stores_padded_chunk(layout)
    return not layout.needs_padding


def plan_gather(
    bucket: BucketLayout, layouts: tuple[ShardLayout, ...], cast_needed: bool,
    exchange: Exchange = Exchange.COLLECTIVE, runtime: RuntimeFacts = TORCH_RUNTIME, bit_cast: bool = False,
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

    A runtime whose collectives allocate their own outputs (``runtime.collectives_in_place`` off)
    has no output to pack into before the exchange. Where reclaiming a view frees nothing
    (``runtime.reclaims_views`` off), the unsharded parameter is never a view: it is the output
    itself when a lone dim-0 shard without padding gathers straight into the parameter's shape and
    travels as its own dtype (``bit_cast``: the bytes travel reinterpreted as another dtype, and
    reading them back is a view), otherwise its own storage.
    """
    lone = bucket.is_single
    layout = layouts[bucket.members[0]]
    if exchange is Exchange.CUSTOM:
        # The user's collective gathers in place into a buffer of its allocator: this rank's chunk of
        # it is packed as the input, and the parameters are copied out (that buffer is not ours to keep).
        return GatherPlan(Ownership.OWNED, Ownership.OWNED, Unsharded.OWN_STORAGE, packs_into_output=True,
                          output_pooled=True)
    borrow_input = lone and not cast_needed and shard_is_padded_chunk(layout, runtime)
    if runtime.reclaims_views:
        unsharded = Unsharded.VIEW_OF_OUTPUT if lone and layout.gather_is_prefix else Unsharded.OWN_STORAGE
    else:
        whole = lone and layout.dim == 0 and not layout.needs_padding and not bit_cast
        unsharded = Unsharded.OUTPUT if whole else Unsharded.OWN_STORAGE
    return GatherPlan(
        input=Ownership.BORROWED if borrow_input else Ownership.OWNED,
        output=Ownership.OWNED,
        unsharded=unsharded,
        packs_into_output=(
            not borrow_input and runtime.collectives_in_place and exchange in (Exchange.PAIRWISE, Exchange.LOCAL)
        ),
    )


def plan_replica(cast_needed: bool) -> Unsharded:
    """What a replicated parameter (``no_shard``) computes with: nothing is gathered.

    The replica itself (``REPLICA``, borrowed: never freed, resized or written by fullshard), whatever its
    tensor type, unless computing needs another dtype or device (``cast_needed``): then a copy in storage
    of fullshard's own (``OWN_STORAGE``), made by allocating and copying (a same-dtype or subclass ``to()``
    may return the replica itself), refreshed before each use and reclaimed on reshard.
    """
    return Unsharded.OWN_STORAGE if cast_needed else Unsharded.REPLICA


def plan_accumulation(grad_dtype_is_reduce_dtype: bool, runtime: RuntimeFacts = TORCH_RUNTIME) -> Accumulation:
    """Where gradients are summed while gradient sync is off (accumulation across backward passes).

    Where autograd sums into the gradient it holds and that gradient already is in the reduce dtype,
    nothing is copied: autograd's own sum is reduced at the synced backward. Where a parameter may hold a
    gradient of another dtype (``runtime.grads_in_any_dtype``), the sum stays autograd's in the reduce dtype
    too, as FSDP2 2.15 leaves it: the first gradient is converted once, and autograd casts the later ones
    to it; the pending sum is the unsharded parameter's ``.grad`` for the user's code to read, edit or
    clear. Otherwise (older torch, or a runtime whose autograd returns new gradients each time) into an
    accumulator fullshard allocates, casts or copies into, and owns.
    """
    if not runtime.autograd_accumulates:
        return Accumulation.OWNED
    if grad_dtype_is_reduce_dtype:
        return Accumulation.IN_AUTOGRAD
    return Accumulation.CONVERTED_IN_AUTOGRAD if runtime.grads_in_any_dtype else Accumulation.OWNED


@dataclass(frozen=True)
class ReduceFacts:
    """What one bucket's gradient reduction is, as far as its ownership depends on it (what a runtime reports)."""

    grad_dtype_is_wire_dtype: bool  # every gradient already is in the dtype it travels in
    grads_contiguous: bool  # every gradient is a plain, contiguous tensor
    reduce_dtype_is_param_dtype: bool  # the reduced value can become the sharded gradient without a cast
    all_reduce: bool = False  # replicated parameters (no_shard): whole gradients all-reduced
    offloaded: bool = False  # the shards live in host memory
    exchange: Exchange = Exchange.COLLECTIVE
    divides: bool = True  # the sum is divided (the mean over ranks) before it is handed out
    # This rank holds every member's gradient; where it lacks one, an owned input holds zeros in its place.
    grads_present: bool = True


def plan_reduce(bucket: BucketLayout, layouts: tuple[ShardLayout, ...], facts: ReduceFacts,
                runtime: RuntimeFacts = TORCH_RUNTIME) -> ReducePlan:
    """Reduce-scatter (or, replicated, all-reduce) of one bucket.

    The caller's gradient is reused as the collective's input (zero copy) only
    when it already is, byte for byte, the input the collective needs: one
    parameter, prefix layout, no padding, the dtype it travels in (the reduce
    dtype, or its own with the pairwise exchange; ``plan.exchange.wire_dtype``),
    contiguous. In that case it is BORROWED: fullshard never resizes it nor
    writes into it, and releases it by dropping the reference. Otherwise
    fullshard allocates the input and copies (casting, padding) into it.

    The output is allocated by fullshard; the gradient division is done in
    place on it (it is owned), then it is handed to the sharded ``.grad`` and
    never freed by fullshard again (``ShardedGrad.VIEW_OF_OUTPUT``), or copied
    out of it (``COPY``: a cast, offloaded shards, interleaved layouts).

    An all-reduce works in place on its buffer (on torch), so its input is owned
    there: the caller's gradient is never written. Where collectives only read
    their input (``runtime.collectives_in_place`` off), it may borrow the gradient
    as a reduce-scatter does. The user's collective (``Exchange.CUSTOM``) reads
    from a buffer of its own allocator: always packed there, and dropped
    afterwards, never resized.

    Where tensors cannot be scaled in place (``runtime.in_place_arithmetic``
    off), a divided gradient comes out of the division as a copy. An emulated
    reduce-scatter (``Exchange.ALL_REDUCE_CHUNK``) outputs the whole summed
    buffer: a view of this rank's chunk would keep all of it alive, so it is copied.
    """
    scaled_in_place = runtime.in_place_arithmetic or not facts.divides
    keeps_dtype = facts.reduce_dtype_is_param_dtype and not facts.offloaded and scaled_in_place
    prefix = all(layouts[i].gather_is_prefix for i in bucket.members)
    if facts.exchange is Exchange.CUSTOM and not facts.all_reduce:
        return ReducePlan(Ownership.OWNED, Ownership.OWNED, _sharded_grad(keeps_dtype and prefix), input_pooled=True)
    borrow = bucket.is_single and facts.grads_present and facts.grad_dtype_is_wire_dtype and facts.grads_contiguous
    if facts.all_reduce:
        return ReducePlan(_owned_unless(borrow and not runtime.collectives_in_place), Ownership.OWNED,
                          _sharded_grad(keeps_dtype))
    layout = layouts[bucket.members[0]]
    borrow = borrow and layout.gather_is_prefix and not layout.needs_padding
    view = keeps_dtype and prefix and facts.exchange is not Exchange.ALL_REDUCE_CHUNK
    return ReducePlan(_owned_unless(borrow), Ownership.OWNED, _sharded_grad(view))


def _owned_unless(borrow: bool) -> Ownership:
    return Ownership.BORROWED if borrow else Ownership.OWNED


def _sharded_grad(view: bool) -> ShardedGrad:
    return ShardedGrad.VIEW_OF_OUTPUT if view else ShardedGrad.COPY


def grad_copy_may_be_async(pinned: bool, accumulates: bool) -> bool:
    """Whether a reduced gradient may be copied to pinned host memory without blocking (CPU offload).

    The copy completes later, on the device's stream; only the end of backward
    waits for it. A copy that is summed into an existing gradient right away
    (accumulation across backward passes) must have landed first, so it blocks.
    """
    return pinned and not accumulates
