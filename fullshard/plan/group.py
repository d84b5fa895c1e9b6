"""Everything the plan decides about one group, for both runtimes (pure): where each parameter's elements live
(shards, padding, buckets), when the group gathers, reshards and reduces (its strategy), and the
:class:`GroupPlan` that asks ``plan.exchange`` and ``plan.ownership`` once and keeps their answers.

Shards and buckets
------------------
The runtime asks these functions and never re-derives the arithmetic, so what the property tests prove is
what the runtime does. A parameter of ``shape`` sharded on ``dim`` over ``world`` ranks follows DTensor's
``Shard(dim)``: every rank's chunk is ``ceil(shape[dim] / world)`` long on ``dim``; the last ranks hold
shorter (possibly empty) chunks. For a collective, every rank contributes one *padded chunk*: its local shard
grown to the full chunk length on ``dim`` (zeros in the padding), laid out contiguously in the chunk's own
row-major order. The all-gather output is then ``world`` padded chunks back to back ("rank-major"). For
``dim == 0`` the first ``numel`` elements of that output are exactly the unsharded parameter; for any other
dim the chunks must be concatenated along ``dim``.

Strategies
----------
The names are those of Megatron-FSDP's ``data_parallel_sharding_strategy``
(and of the seed's configuration). Each one is a set of flags on the same
runtime:

=====================  ==============  =================  ==================  ===================
strategy               stored params   reshard after fwd  reshard after bwd   gradient reduction
=====================  ==============  =================  ==================  ===================
no_shard (DDP)         replicated      no (never gathered) no                  all-reduce, per group
optim (ZeRO-1)         sharded         no                 no (kept, refreshed) reduce-scatter, once at end of backward
optim_grads (ZeRO-2)   sharded         no                 no (kept, refreshed) reduce-scatter, per group
optim_grads_params     sharded         yes (not root)     yes                 reduce-scatter, per group
=====================  ==============  =================  ==================  ===================

"Kept, refreshed": the unsharded parameters stay allocated across steps and
are all-gathered again (into the same storage) in the first forward after a
synced backward, since the optimizer changed the shards in between.

The group plan
--------------
A runtime describes its parameters in framework-free facts (:class:`ParamFacts`: a layout, dtype names,
trainability) and its group's collectives. Nothing here touches a tensor. Dtypes are names ("bfloat16"); a
runtime turns them into its own. The parameters themselves (the runtime's objects, with ``fqn`` and
``local_fqn``) are only named: errors and profiler labels name them by their path from the root, which is
known once the root adopts the unit (:meth:`GroupPlan.rename`).
"""
from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from math import prod
from typing import Any, Hashable, Optional, Sequence

from fullshard.plan.exchange import (

    Backend, Collectives, Exchange, carrier_dtype, exchange_tag, is_bit_cast, wire_dtype,

)
from fullshard.plan.ownership import (
    TORCH_RUNTIME, Accumulation, GatherPlan, RuntimeFacts, Unsharded, plan_accumulation, plan_gather, plan_replica,
)


# Parameters whose per-rank chunk has fewer elements than this share one collective (fusion) when a
# runtime fuses; larger ones travel alone, so they can be gathered straight into their own storage.
DEFAULT_FUSE_BELOW_NUMEL = 1 << 16

# A runtime whose collectives block (MindSpore on CPU) reduces the gradients of several units together until
# their unsharded bytes reach this: fewer, larger collectives inside the backward, at the cost of holding
# those gradients (autograd's, borrowed) that much longer. Runtimes with asynchronous collectives reduce each
# unit's at once and overlap them with the backward (0).
FUSE_REDUCTIONS_BELOW_BYTES = 8 << 20


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class ShardLayout:
    """One parameter sharded on one dim over one group of ranks."""

    shape: tuple[int, ...]
    dim: int
    world: int

    def __post_init__(self) -> None:
        if self.world < 1:
            raise ValueError(f"world size must be >= 1, got {self.world}")
        if not self.shape:
            raise ValueError("a 0-dim (scalar) parameter cannot be sharded on a dim")
        if not 0 <= self.dim < len(self.shape):
            raise ValueError(
                f"shard dim {self.dim} is out of range for a parameter of shape "
                f"{self.shape} (valid dims: 0..{len(self.shape) - 1})"
            )
        if any(s < 0 for s in self.shape):
            raise ValueError(f"negative size in shape {self.shape}")

    @property
    def numel(self) -> int:
        return prod(self.shape)

    @property
    def dim_size(self) -> int:
        return self.shape[self.dim]

    @property
    def chunk(self) -> int:
        """Length on ``dim`` of every rank's padded chunk."""
        return ceil_div(self.dim_size, self.world)

    @property
    def needs_padding(self) -> bool:
        return self.chunk * self.world != self.dim_size

    @property
    def padded_chunk_shape(self) -> tuple[int, ...]:
        return self.shape[: self.dim] + (self.chunk,) + self.shape[self.dim + 1 :]

    @property
    def padded_chunk_numel(self) -> int:
        return prod(self.padded_chunk_shape)

    @property
    def padded_shape(self) -> tuple[int, ...]:
        """The unsharded shape grown so ``dim`` divides evenly."""
        return self.shape[: self.dim] + (self.chunk * self.world,) + self.shape[self.dim + 1 :]

    def local_length(self, rank: int) -> int:
        """Rows (on ``dim``) rank ``rank`` really holds: the DTensor local shard."""
        self._check_rank(rank)
        return max(0, min(self.chunk, self.dim_size - rank * self.chunk))

    def local_offset(self, rank: int) -> int:
        """First global index on ``dim`` of rank ``rank``'s shard (clamped for empty shards)."""
        self._check_rank(rank)
        return min(rank * self.chunk, self.dim_size)

    def local_shape(self, rank: int) -> tuple[int, ...]:
        return self.shape[: self.dim] + (self.local_length(rank),) + self.shape[self.dim + 1 :]

    def local_numel(self, rank: int) -> int:
        return prod(self.local_shape(rank))

    @property
    def gather_is_prefix(self) -> bool:
        """True when the unsharded parameter is a prefix view of the all-gather output.

        Holds when every dim before ``dim`` has size 1 (always for ``dim == 0``):
        the rank-major chunks are then the rows in order. Otherwise chunks
        interleave and need a concatenation along ``dim``.
        """
        return prod(self.shape[: self.dim]) == 1

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} is outside a group of {self.world}")


@dataclass(frozen=True)
class BucketLayout:
    """Several parameters that share one collective.

    Each rank's contribution is the padded chunks of ``members`` back to back;
    ``offsets[i]`` is where member ``i`` starts inside that contribution.
    """

    members: tuple[int, ...]
    offsets: tuple[int, ...]
    chunk_numel: int
    world: int
    # Every member is a row block (``members_are_row_blocks``): packed and unpacked by one fused copy.
    row_blocks: bool = False
    # A reduction's layout may end each rank's contribution with one count per member (:meth:`with_presence`):
    # where those counts start; None: none.
    presence_offset: Optional[int] = None
    # After its members' counts, those of these parameters (indices), each a single-member bucket of the group
    # whose own buffer carries none (:func:`plan_presence`).
    solos: tuple[int, ...] = ()

    def with_presence(self, solos: tuple[int, ...] = ()) -> "BucketLayout":
        """This bucket for a reduction that also tells every rank which members any rank had a gradient for.

        Each rank's contribution ends with one element per member, 1 where this rank holds a gradient and 0
        where it holds none (zeros stand in for that gradient): the sum each rank receives counts, per member,
        the ranks that had one. A member no rank had a gradient for then gets none (a reference would leave it
        without one, and an optimizer skips it), one that some rank had gets the reduced gradient on every rank
        (MoE experts that some ranks skipped). The counts are a few elements per bucket; they travel, and are
        counted, with it. ``solos``: the counts of single-member buckets travel here too (:func:`plan_presence`).
        """
        return dataclasses.replace(self, chunk_numel=self.chunk_numel + len(self.members) + len(solos),
                                   presence_offset=self.chunk_numel, solos=solos)

    @property
    def presence_numel(self) -> int:  # the counts each rank's contribution carries beyond the gradients
        return 0 if self.presence_offset is None else len(self.members) + len(self.solos)

    @property
    def total_numel(self) -> int:
        """Elements of the all-gather output / reduce-scatter input."""
        return self.chunk_numel * self.world

    @property
    def is_single(self) -> bool:
        return len(self.members) == 1

    def member_span(self, member_index: int, layouts: Sequence[ShardLayout]) -> tuple[int, int]:
        """(start, end) of a member's padded chunk inside one rank's contribution."""
        start = self.offsets[member_index]
        return start, start + layouts[self.members[member_index]].padded_chunk_numel


def members_are_row_blocks(layouts: Sequence[ShardLayout]) -> bool:
    """True when each member's whole tensor, viewed as ``(world, numel / world)``,
    is its column block of the bucket's rank-major buffer viewed as ``(world, chunk_numel)``.

    That holds when every member is gathered as a prefix (sharded on its
    leading non-trivial dim) and needs no padding: rank r's chunk is then the
    r-th contiguous ``numel / world`` elements of the tensor. Packing or
    unpacking such a bucket is one fused copy instead of one per member and rank.
    """
    return all(layout.gather_is_prefix and not layout.needs_padding for layout in layouts)


def plan_buckets(
    layouts: Sequence[ShardLayout],
    fuse_below_numel: int,
    kinds: Optional[Sequence[Hashable]] = None,
) -> tuple[BucketLayout, ...]:
    """Group parameters into collectives.

    A parameter whose padded chunk has at least ``fuse_below_numel`` elements
    gets a collective of its own (so it can be gathered straight into its own
    storage, see ``ownership``); smaller ones are fused, in order, into buckets
    of at least that many elements per rank. Only parameters of the same
    ``kinds`` entry (e.g. dtypes and trainability) share a bucket.
    ``fuse_below_numel <= 0`` gives every parameter its own collective.
    """
    if not layouts:
        return ()
    worlds = {l.world for l in layouts}
    if len(worlds) != 1:
        raise ValueError(f"parameters of one group must share a world size, got {sorted(worlds)}")
    if kinds is None:
        kinds = [None] * len(layouts)
    if len(kinds) != len(layouts):
        raise ValueError("kinds must have one entry per layout")
    world = worlds.pop()
    buckets: list[BucketLayout] = []
    pending: dict[Hashable, list[int]] = {}

    def close(indices: list[int]) -> None:
        offsets, running = [], 0
        for i in indices:
            offsets.append(running)
            running += layouts[i].padded_chunk_numel
        row_blocks = members_are_row_blocks([layouts[i] for i in indices])
        buckets.append(BucketLayout(tuple(indices), tuple(offsets), running, world, row_blocks))

    for i, (layout, kind) in enumerate(zip(layouts, kinds)):
        if layout.padded_chunk_numel >= fuse_below_numel:
            close([i])
            continue
        members = pending.setdefault(kind, [])
        members.append(i)
        if sum(layouts[j].padded_chunk_numel for j in members) >= fuse_below_numel:
            close(pending.pop(kind))
    for members in pending.values():
        close(members)
    return tuple(buckets)


def fused_bucket(layouts: Sequence[ShardLayout]) -> BucketLayout:
    """Every parameter of ``layouts`` in one bucket, in order: one collective for all of them (a reduction
    batched across a unit's buckets, or across units)."""
    buckets = plan_buckets(layouts, fuse_below_numel=sum(l.padded_chunk_numel for l in layouts) + 1)
    if len(buckets) != 1:
        raise ValueError(f"{len(layouts)} parameters make {len(buckets)} buckets, not one")
    return buckets[0]


def plan_presence(buckets: Sequence[BucketLayout], trainable: Sequence[bool]
                  ) -> tuple[list[BucketLayout], Optional[BucketLayout]]:
    """The reductions' layouts where a rank may lack gradients (every rank reduces every trainable bucket, a
    zero standing in, so all issue the same collectives), and the counts-only reduction, if any. A fused bucket
    counts its members. A single one carries no counts, so its gradient can still be the collective's buffer as
    it is (zero copy, ``plan.ownership.plan_reduce``): those of every trainable one travel in the group's first
    trainable fused bucket, in the same pass; where it has none, in a reduction of the counts alone (else None).
    """
    solos = tuple(b.members[0] for b in buckets if b.is_single and trainable[b.members[0]])
    carrier = next((i for i, b in enumerate(buckets) if not b.is_single and trainable[b.members[0]]), None)
    layouts = [b if b.is_single else b.with_presence(solos if i == carrier else ()) for i, b in enumerate(buckets)]
    counts_only = BucketLayout((), (), 0, buckets[0].world).with_presence(solos) if solos and carrier is None else None
    return layouts, counts_only


# ---------------------------------------------------------------------------------------------- strategies
class Strategy(enum.Enum):
    NO_SHARD = "no_shard"
    OPTIM = "optim"
    OPTIM_GRADS = "optim_grads"
    OPTIM_GRADS_PARAMS = "optim_grads_params"

    @classmethod
    def parse(cls, name: "str | Strategy") -> "Strategy":
        if isinstance(name, Strategy):
            return name
        try:
            return cls(name)
        except ValueError:
            names = ", ".join(repr(s.value) for s in cls)
            raise ValueError(f"unknown strategy {name!r}; choose one of {names}") from None


class AfterBackward(enum.Enum):
    """What a unit does with its gathered parameters once its backward is done."""

    RESHARD = "reshard"  # free them (ZeRO-3)
    # Keep the storage but show the shards, and gather into it again before the next use: after a
    # synced backward the optimizer steps (ZeRO-1/2; without sync they stay gathered, accumulating).
    KEEP_STORAGE = "keep storage"
    # Keep them gathered for the next forward, synced or not (FSDP2's set_reshard_after_backward(False),
    # for accumulation): the caller promises no write below autograd before then; a write through it
    # (an optimizer step) still moves a version counter and gathers again.
    KEEP_GATHERED = "keep gathered"


@dataclass(frozen=True)
class Lifecycle:
    reshard_after_forward: bool
    reshard_after_backward: bool
    all_reduce: bool  # True: all-reduce full gradients (replicated); False: reduce-scatter
    reduce_at_end_of_backward: bool  # True: one reduction pass after the whole backward (ZeRO-1)


def lifecycle(strategy: Strategy, is_root: bool, reshard_after_forward: Optional[bool] = None) -> Lifecycle:
    """The flags of ``strategy``; an explicit ``reshard_after_forward`` (FSDP2's argument) wins."""
    if strategy is Strategy.NO_SHARD:
        return Lifecycle(False, False, True, False)
    if strategy is Strategy.OPTIM_GRADS_PARAMS:
        after_forward = (not is_root) if reshard_after_forward is None else reshard_after_forward
        return Lifecycle(after_forward, True, False, False)
    after_forward = False if reshard_after_forward is None else reshard_after_forward
    return Lifecycle(after_forward, False, False, strategy is Strategy.OPTIM)


# ---------------------------------------------------------------------------------------------- the group plan
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
    # The dtype its gradient accumulates in when no reduce dtype is set, where the runtime's rule promotes
    # (:class:`GroupPlan`'s ``promote_grad_dtypes``): its own dtype, or one asked for it explicitly. None: its
    # compute dtype (the gradient as autograd makes it).
    accumulation_dtype: Optional[str] = None


# Floating dtypes by width; two different ones of one width (float16, bfloat16) meet in float32.
_FLOAT_WIDTH = {"float16": 16, "bfloat16": 16, "float32": 32, "float64": 64}


def promote_float_dtypes(names: Sequence[str]) -> str:
    """The dtype that holds every dtype of ``names`` (dtype names), as type promotion gives it."""
    distinct = sorted(set(names))
    if len(distinct) == 1:
        return distinct[0]
    unknown = [n for n in distinct if n not in _FLOAT_WIDTH]
    if unknown or not distinct:
        raise ValueError(f"cannot promote the gradient dtypes {distinct}: only {sorted(_FLOAT_WIDTH)} are planned")
    widest = max(_FLOAT_WIDTH[n] for n in distinct)
    winners = [n for n in distinct if _FLOAT_WIDTH[n] == widest]
    return winners[0] if len(winners) == 1 else "float32"


class GroupPlan:
    """The plan of one group: ``params`` (the runtime's, named here) described by ``facts``."""

    def __init__(self, params: Sequence[Any], facts: Sequence[ParamFacts], module_name: str, owner_kind: str,
                 reduce_dtype: Optional[str], fuse_below_numel: int, collectives: Collectives, backend: Backend,
                 runtime: RuntimeFacts = TORCH_RUNTIME, promote_grad_dtypes: bool = False) -> None:
        self.params = list(params)
        self.facts = list(facts)
        self.module_name, self.owner_kind = module_name, owner_kind  # owner_kind: "module" or "cell"
        # Without a reduce dtype, the gradients are summed in their compute dtype, each bucket in its own; or,
        # with ``promote_grad_dtypes`` (the runtime's version of FSDP2 says which: torch 2.15 does), the whole
        # group in the one dtype that holds every trainable parameter's accumulation dtype (fp32 parameters
        # computing in bf16 reduce in fp32).
        self._reduce_dtype = reduce_dtype or (self._promoted_grad_dtype() if promote_grad_dtypes else None)
        self.fuse_below_numel = fuse_below_numel  # gradients this large are reduced alone, too
        self.collectives, self.backend = collectives, backend
        self.layouts = tuple(f.layout for f in facts)
        # Only parameters of the same dtypes and trainability share a buffer; one with its own gather hooks
        # travels alone.
        kinds = tuple(("alone", i) if f.travels_alone else (f.stored_dtype, f.compute_dtype, f.requires_grad)
                      for i, f in enumerate(facts))
        self.buckets: list[BucketLayout] = plan_buckets(self.layouts, fuse_below_numel, kinds)
        # Where a rank may lack some gradients, the reductions also count which parameters any rank had one for.
        self.reduce_buckets, self.counts_only = plan_presence(self.buckets, [f.requires_grad for f in facts]) \
            if runtime.grads_may_be_absent else (list(self.buckets), None)
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

    @property
    def presence_numel(self) -> int:  # the counts one rank's chunk of a synced reduction pass carries (traffic)
        carried = sum(b.presence_numel for b in self.reduce_buckets if self.facts[b.members[0]].requires_grad)
        return carried + (self.counts_only.presence_numel if self.counts_only is not None else 0)

    # ------------------------------------------------------------------ dtypes
    def _promoted_grad_dtype(self) -> Optional[str]:
        dtypes = [f.accumulation_dtype or f.compute_dtype for f in self.facts if f.requires_grad]
        return promote_float_dtypes(dtypes) if dtypes else None

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
        if self.counts_only is not None:
            self.counts_label = f"presence counts of {self._label(self.counts_only.solos)}"
            self.counts_tag = exchange_tag(self.counts_label, "reduce_scatter")

    def _label(self, members: tuple[int, ...]) -> str:
        names = ", ".join(self.params[i].fqn for i in members[:3])
        more = f" and {len(members) - 3} more" if len(members) > 3 else ""
        return f"[{names}{more}] of {self.owner_kind} '{self.module_name}'"
