"""Packing and unpacking fused buckets (no processes): the one-copy path for row-block buckets.

A bucket whose members are row blocks (``BucketLayout.row_blocks``, from the plan) is
packed and unpacked by one fused copy; others fall back to a copy per member
and rank. Both must lay out exactly what the plan says.
"""
from types import SimpleNamespace

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fullshard.plan import ShardLayout, plan_buckets
from fullshard.torch.buckets import _pack_local_chunks, pack_rank_chunks, unpack_rank_chunks


class CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.is_mutable:  # writes: the copies that matter
            self.ops.append(func.__name__)
        return func(*args, **(kwargs or {}))


def _members(shapes_dims, world, dtype=torch.float32):
    layouts = [ShardLayout(shape, dim, world) for shape, dim in shapes_dims]
    bucket = plan_buckets(layouts, fuse_below_numel=1 << 30)[0]  # everything in one bucket
    params = [SimpleNamespace(layout=layout, storage_device=torch.device("cpu")) for layout in layouts]
    fulls = [torch.randn(layout.shape, dtype=dtype) for layout in layouts]
    return bucket, params, fulls


def _reference_rows(bucket, params, fulls):
    """Each rank's padded chunks back to back, built element by element from the layout."""
    rows = torch.zeros(bucket.world, bucket.chunk_numel, dtype=fulls[0].dtype)
    for rank in range(bucket.world):
        for offset, param, full in zip(bucket.offsets, params, fulls):
            layout = param.layout
            padded = torch.zeros(layout.padded_chunk_shape, dtype=full.dtype)
            length = layout.local_length(rank)
            padded.narrow(layout.dim, 0, length).copy_(full.narrow(layout.dim, layout.local_offset(rank), length))
            rows[rank, offset : offset + layout.padded_chunk_numel] = padded.reshape(-1)
    return rows


ROW_BLOCKS = [((8, 3), 0), ((6,), 0), ((1, 4), 1), ((4, 2, 2), 0)]
PADDED = [((8, 3), 0), ((5,), 0), ((3, 4), 1)]


def test_row_block_buckets_pack_and_unpack_with_one_copy():
    bucket, params, fulls = _members(ROW_BLOCKS, world=2)
    assert bucket.row_blocks
    flat = torch.empty(bucket.total_numel)
    with CountOps() as packing:
        pack_rank_chunks(flat, bucket, params, fulls)
    assert torch.equal(flat.view(bucket.world, -1), _reference_rows(bucket, params, fulls))
    assert packing.ops == ["cat.out"]

    restored = [torch.empty_like(full) for full in fulls]
    with CountOps() as unpacking:
        unpack_rank_chunks(flat, bucket, params, restored)
    assert all(torch.equal(a, b) for a, b in zip(restored, fulls))
    assert unpacking.ops == ["split_with_sizes_copy.out"]


def test_packing_casts_to_the_buffer_dtype_in_the_same_copy():
    bucket, params, grads = _members(ROW_BLOCKS, world=2, dtype=torch.bfloat16)
    flat = torch.empty(bucket.total_numel, dtype=torch.float32)
    pack_rank_chunks(flat, bucket, params, grads)
    assert torch.equal(flat.view(bucket.world, -1), _reference_rows(bucket, params, grads).float())


def test_a_subset_of_ranks_packs_their_rows_only():
    bucket, params, fulls = _members(ROW_BLOCKS, world=4)
    kept = torch.empty(2 * bucket.chunk_numel)
    pack_rank_chunks(kept, bucket, params, fulls, range(2, 4))
    assert torch.equal(kept.view(2, -1), _reference_rows(bucket, params, fulls)[2:4])


def test_own_row_is_packed_with_one_copy():
    bucket, params, fulls = _members(ROW_BLOCKS, world=2)
    for param, full in zip(params, fulls):
        layout = param.layout
        param.padded_chunk = None
        param.local_shard = (lambda f=full, l=layout: f.narrow(l.dim, l.local_offset(1), l.local_length(1)))
    row = torch.empty(bucket.chunk_numel)
    with CountOps() as packing:
        _pack_local_chunks(row, bucket, params)
    assert torch.equal(row, _reference_rows(bucket, params, fulls)[1])
    assert packing.ops == ["cat.out"]


def test_padded_or_interleaved_members_fall_back_and_stay_exact():
    bucket, params, fulls = _members(PADDED, world=2)
    assert not bucket.row_blocks
    flat = torch.full((bucket.total_numel,), float("nan"))
    pack_rank_chunks(flat, bucket, params, fulls)
    assert torch.equal(flat.view(bucket.world, -1), _reference_rows(bucket, params, fulls))
    restored = [torch.empty_like(full) for full in fulls]
    unpack_rank_chunks(flat, bucket, params, restored)
    assert all(torch.equal(a, b) for a, b in zip(restored, fulls))
    pack_rank_chunks(flat, bucket, params, [fulls[0], None, fulls[2]])  # a member without a gradient: zeros
    expected = _reference_rows(bucket, params, [fulls[0], torch.zeros_like(fulls[1]), fulls[2]])
    assert torch.equal(flat.view(bucket.world, -1), expected)
