"""Where every element of a parameter lives: shard sizes, padding, collective layouts.

Pure Python (no torch). The runtime asks these functions and never re-derives
the arithmetic, so what the property tests prove is what the runtime does.

Conventions
-----------
A parameter of ``shape`` sharded on ``dim`` over ``world`` ranks follows
DTensor's ``Shard(dim)``: every rank's chunk is ``ceil(shape[dim] / world)``
long on ``dim``; the last ranks hold shorter (possibly empty) chunks.

For a collective, every rank contributes one *padded chunk*: its local shard
grown to the full chunk length on ``dim`` (zeros in the padding), laid out
contiguously in the chunk's own row-major order. The all-gather output is then
``world`` padded chunks back to back ("rank-major"). For ``dim == 0`` the
first ``numel`` elements of that output are exactly the unsharded parameter;
for any other dim the chunks must be concatenated along ``dim``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from math import prod
from typing import Hashable, Optional, Sequence


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

    def with_presence(self) -> "BucketLayout":
        """This bucket for a reduction that also tells every rank which members any rank had a gradient for.

        Each rank's contribution ends with one element per member, 1 where this rank holds a gradient and 0
        where it holds none (zeros stand in for that gradient): the sum each rank receives counts, per member,
        the ranks that had one. A member no rank had a gradient for then gets none (a reference would leave it
        without one, and an optimizer skips it), one that some rank had gets the reduced gradient on every rank
        (MoE experts that some ranks skipped). The counts are a few elements per bucket; they travel, and are
        counted, with it.
        """
        return dataclasses.replace(self, chunk_numel=self.chunk_numel + len(self.members),
                                   presence_offset=self.chunk_numel)

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
