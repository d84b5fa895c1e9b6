"""Unit and property tests of the framework-free planning code (no processes).

torch appears here only as the oracle: the plan's layouts must reproduce what
DTensor's Shard(dim) and the runtime's collectives do with real tensors, and
its ownership decisions must agree with what torch's operations allocate.
"""
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings, strategies as st

from fullshard.plan import (
    ReduceFacts,
    Exchange,
    Ownership,
    ShardedGrad,
    ShardLayout,
    Unsharded,
    choose_exchange,
    exchange_tag,
    members_are_row_blocks,
    plan_buckets,
    plan_gather,
    plan_reduce,
    reduce_scratch_chunks,
    stores_padded_chunk,
    wire_dtype,
)
from fullshard.plan.formulas import (
    DTYPE_BYTES, bytes_sent_per_rank, gradient_wire_bytes, peak_state_bytes, per_rank_theory, traffic_bytes_per_step,
)
from fullshard.plan.exchange import MAX_PAIRWISE_RANKS, backend_for_device
from fullshard.plan.group import Strategy, plan_presence

shapes = st.lists(st.integers(0, 9), min_size=1, max_size=4).map(tuple)


@st.composite
def layouts(draw):
    shape = draw(shapes)
    dim = draw(st.integers(0, len(shape) - 1))
    world = draw(st.integers(1, 8))
    return ShardLayout(shape, dim, world)


def padded_chunks(full: torch.Tensor, layout: ShardLayout) -> list[torch.Tensor]:
    """What each rank contributes to a collective: its local shard, zero-padded to the chunk."""
    chunks = []
    for rank in range(layout.world):
        local = full.narrow(layout.dim, layout.local_offset(rank), layout.local_length(rank))
        padded = torch.zeros(layout.padded_chunk_shape, dtype=full.dtype)
        padded.narrow(layout.dim, 0, local.shape[layout.dim]).copy_(local)
        chunks.append(padded)
    return chunks


@settings(max_examples=300, deadline=None)
@given(layouts())
def test_local_shards_match_dtensor_chunking(layout):
    full = torch.arange(layout.numel, dtype=torch.float32).reshape(layout.shape)
    expected = list(torch.chunk(full, layout.world, dim=layout.dim)) if layout.dim_size else []
    for rank in range(layout.world):
        local = full.narrow(layout.dim, layout.local_offset(rank), layout.local_length(rank))
        assert tuple(local.shape) == layout.local_shape(rank)
        if rank < len(expected):
            assert torch.equal(local, expected[rank])
        else:  # DTensor gives the trailing ranks empty shards
            assert local.shape[layout.dim] == 0
    assert sum(layout.local_length(r) for r in range(layout.world)) == layout.dim_size


@settings(max_examples=300, deadline=None)
@given(layouts())
def test_shard_then_gather_is_identity_and_padding_is_stripped(layout):
    full = torch.randn(layout.shape)
    gathered = torch.cat([c.reshape(-1) for c in padded_chunks(full, layout)])  # all-gather output
    assert gathered.numel() == layout.padded_chunk_numel * layout.world
    if layout.gather_is_prefix:
        unsharded = gathered[: layout.numel].view(layout.shape)
    else:
        chunks = gathered.view(layout.world, *layout.padded_chunk_shape).unbind(0)
        unsharded = torch.cat(chunks, dim=layout.dim).narrow(layout.dim, 0, layout.dim_size)
    assert torch.equal(unsharded, full)


@settings(max_examples=300, deadline=None)
@given(layouts())
def test_reduce_scatter_layout_gives_each_rank_its_shard(layout):
    # Two "ranks' gradients" summed by a reduce-scatter over the packed layout.
    grads = [torch.randn(layout.shape) for _ in range(2)]
    packed = [torch.cat([c.reshape(-1) for c in padded_chunks(g, layout)]) for g in grads]
    summed = (packed[0] + packed[1]).view(layout.world, layout.padded_chunk_numel)
    total = grads[0] + grads[1]
    for rank in range(layout.world):
        chunk = summed[rank].view(layout.padded_chunk_shape).narrow(layout.dim, 0, layout.local_length(rank))
        expected = total.narrow(layout.dim, layout.local_offset(rank), layout.local_length(rank))
        assert torch.equal(chunk, expected)
        if layout.gather_is_prefix:  # the sharded grad can be a prefix view
            assert torch.equal(summed[rank][: layout.local_numel(rank)].view(layout.local_shape(rank)), expected)


@settings(max_examples=200, deadline=None)
@given(st.lists(layouts(), min_size=1, max_size=12), st.integers(0, 64), st.data())
def test_buckets_cover_every_parameter_once_without_overlap(candidates, threshold, data):
    world = candidates[0].world
    params = [ShardLayout(l.shape, l.dim, world) for l in candidates]
    kinds = data.draw(st.lists(st.sampled_from("ab"), min_size=len(params), max_size=len(params)))
    buckets = plan_buckets(params, threshold, kinds)
    members = [m for b in buckets for m in b.members]
    assert sorted(members) == list(range(len(params)))
    for bucket in buckets:
        assert len({kinds[m] for m in bucket.members}) == 1
        assert bucket.row_blocks == members_are_row_blocks([params[m] for m in bucket.members])
        spans = [bucket.member_span(i, params) for i in range(len(bucket.members))]
        for (start, end), (next_start, _) in zip(spans, spans[1:]):
            assert end == next_start  # packed back to back: no overlap, no gap
        assert spans[0][0] == 0 and spans[-1][1] == bucket.chunk_numel
        if len(bucket.members) > 1:
            assert all(params[m].padded_chunk_numel < threshold for m in bucket.members)


@settings(max_examples=200, deadline=None)
@given(st.lists(layouts(), min_size=1, max_size=6))
def test_row_block_buckets_are_whole_tensors_side_by_side(candidates):
    """Where the plan says so, a bucket's rank-major buffer is the members' (world, -1) views concatenated."""
    world = candidates[0].world
    params = [ShardLayout(l.shape, l.dim, world) for l in candidates]
    fulls = [torch.randn(l.shape) for l in params]
    rank_major = torch.cat(  # what the runtime packs: each rank's padded chunks back to back
        [torch.cat([padded_chunks(f, l)[rank].reshape(-1) for f, l in zip(fulls, params)]) for rank in range(world)]
    )
    if members_are_row_blocks(params):
        fused = torch.cat([f.reshape(world, -1) for f in fulls], dim=1)
        assert torch.equal(fused.reshape(-1), rank_major)


def test_row_blocks_exclude_padding_and_interleaved_dims():
    assert members_are_row_blocks([ShardLayout((4, 3), 0, 2), ShardLayout((1, 6), 1, 2)])
    assert not members_are_row_blocks([ShardLayout((4, 3), 0, 2), ShardLayout((5,), 0, 2)])  # padded
    assert not members_are_row_blocks([ShardLayout((4, 6), 1, 2)])  # rows of dim 0 interleave


def test_large_parameters_travel_alone():
    big, small = ShardLayout((64, 4), 0, 2), ShardLayout((3,), 0, 2)
    buckets = plan_buckets([small, big, small], fuse_below_numel=16)
    assert [b.members for b in buckets] == [(1,), (0, 2)]


def test_layout_rejects_bad_input_with_clear_errors():
    with pytest.raises(ValueError, match="out of range"):
        ShardLayout((4, 4), 2, 2)
    with pytest.raises(ValueError, match="scalar"):
        ShardLayout((), 0, 2)
    with pytest.raises(ValueError, match="world size"):
        ShardLayout((4,), 0, 0)


# ----------------------------------------------------------------------------- ownership
def test_gather_plan_truth_table():
    even = ShardLayout((8, 4), 0, 2)
    uneven_dim1 = ShardLayout((4, 5), 1, 2)
    single = plan_buckets([even], 0)[0]
    plan = plan_gather(single, (even,), cast_needed=False)
    assert (plan.input, plan.output, plan.unsharded) == (Ownership.BORROWED, Ownership.OWNED, Unsharded.VIEW_OF_OUTPUT)
    assert plan_gather(single, (even,), cast_needed=True).input is Ownership.OWNED
    lone_dim1 = plan_buckets([uneven_dim1], 0)[0]
    plan = plan_gather(lone_dim1, (uneven_dim1,), cast_needed=False)
    assert not stores_padded_chunk(uneven_dim1)
    assert (plan.input, plan.unsharded) == (Ownership.OWNED, Unsharded.OWN_STORAGE)
    fused = plan_buckets([even, even], 1 << 20)[0]
    assert plan_gather(fused, (even, even), False).unsharded is Unsharded.OWN_STORAGE


@pytest.mark.parametrize(
    "shape, dim, same_dtype, contiguous, borrowed",
    [
        ((8, 4), 0, True, True, True),  # the seed's zero-copy case: even dim-0, same dtype
        ((7, 4), 0, True, True, False),  # padding allocates
        ((8, 4), 0, False, True, False),  # cast allocates
        ((8, 4), 0, True, False, False),  # a strided gradient is packed
        ((4, 8), 1, True, True, False),  # other dims need a re-layout
        ((1, 8), 1, True, True, True),  # ...unless every dim before is 1
    ],
)
def test_reduce_plan_borrows_only_when_the_gradient_is_the_input(shape, dim, same_dtype, contiguous, borrowed):
    layout = ShardLayout(shape, dim, 2)
    bucket = plan_buckets([layout], 0)[0]
    plan = plan_reduce(bucket, (layout,), ReduceFacts(same_dtype, contiguous, reduce_dtype_is_param_dtype=True))
    assert plan.input is (Ownership.BORROWED if borrowed else Ownership.OWNED)
    assert plan.output is Ownership.OWNED


def test_reduce_plan_fused_buckets_always_own_their_input():
    layout = ShardLayout((8, 4), 0, 2)
    bucket = plan_buckets([layout, layout], 1 << 20)[0]
    assert plan_reduce(bucket, (layout, layout), ReduceFacts(True, True, True)).input is Ownership.OWNED


def test_sharded_grad_is_copied_when_it_must_change_dtype():
    layout = ShardLayout((8, 4), 0, 2)
    bucket = plan_buckets([layout], 0)[0]
    assert plan_reduce(bucket, (layout,), ReduceFacts(True, True, True)).sharded_grad is ShardedGrad.VIEW_OF_OUTPUT
    assert plan_reduce(bucket, (layout,), ReduceFacts(False, True, False)).sharded_grad is ShardedGrad.COPY


def test_reduce_plan_zeros_stand_in_for_a_missing_lone_gradient():
    """A rank without a lone parameter's gradient still reduces its bucket: from an owned buffer of zeros."""
    layout = ShardLayout((8, 4), 0, 2)
    bucket = plan_buckets([layout], 0)[0]
    assert plan_reduce(bucket, (layout,), ReduceFacts(True, True, True, grads_present=False)).input is Ownership.OWNED


def test_presence_of_single_buckets_travels_in_the_first_trainable_fused_bucket():
    """Every single bucket keeps its layout (its gradient can be the collective's buffer as it is); their counts,
    one slot each, follow the members' counts of the first fused bucket of trainable parameters."""
    big, small = ShardLayout((64, 4), 0, 2), ShardLayout((2, 4), 0, 2)
    layouts = [big, small, small, big, small, small, big]
    trainable = [True, False, False, True, True, True, False]  # the first fused bucket is frozen; the last big too
    buckets = plan_buckets(layouts, 100, kinds=trainable)
    assert [b.members for b in buckets] == [(0,), (3,), (6,), (1, 2), (4, 5)]
    reduce, counts_only = plan_presence(buckets, trainable)
    assert counts_only is None
    assert reduce[:3] == list(buckets[:3])  # single buckets carry no counts: no copy forced
    carrier = reduce[4]
    assert carrier.solos == (0, 3) and carrier.presence_offset == buckets[4].chunk_numel
    assert carrier.chunk_numel == buckets[4].chunk_numel + 2 + 2 and carrier.presence_numel == 4
    assert reduce[3].solos == () and reduce[3].presence_numel == 2  # a frozen fused bucket carries no solo's
    single = plan_reduce(reduce[0], tuple(layouts), ReduceFacts(True, True, True))
    assert single.input is Ownership.BORROWED  # the zero-copy path stays


def test_presence_of_single_buckets_travels_alone_without_a_fused_bucket():
    big = ShardLayout((64, 4), 0, 2)
    buckets = plan_buckets([big, big, big], 100)
    reduce, counts_only = plan_presence(buckets, [True, False, True])
    assert reduce == list(buckets)
    assert counts_only.members == () and counts_only.solos == (0, 2)
    assert counts_only.presence_offset == 0 and counts_only.chunk_numel == 2 and counts_only.total_numel == 4
    assert plan_presence(buckets, [False, False, False]) == (list(buckets), None)


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ownership_rules_agree_with_torch(dtype):
    """The facts the plan relies on, checked on real tensors."""
    grad = torch.randn(8, 4, dtype=dtype)
    assert _same_storage(grad.to(dtype), grad)  # same-dtype to(): the caller's storage -> BORROWED
    assert _same_storage(grad.reshape(-1), grad)  # reshape of contiguous: a view -> BORROWED
    assert _same_storage(grad.view(-1), grad)
    other = torch.float32 if dtype != torch.float32 else torch.bfloat16
    assert not _same_storage(grad.to(other), grad)  # a real cast allocates -> OWNED
    assert not _same_storage(torch.cat([grad, grad]), grad)  # cat allocates -> OWNED
    padded = torch.nn.functional.pad(grad, (0, 0, 0, 1))
    assert not _same_storage(padded, grad)  # padding allocates -> OWNED


def test_plan_imports_no_framework():
    code = "import sys, fullshard.plan; assert 'torch' not in sys.modules, 'plan imported torch'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_offloaded_shards_get_copied_gradients():
    """Offloaded (CPU) shards: the reduced gradient is copied to the storage device, never a view."""
    layout = ShardLayout((8, 4), 0, 2)
    bucket = plan_buckets([layout], 0)[0]
    plan = plan_reduce(bucket, (layout,), ReduceFacts(True, True, True, offloaded=True))
    assert plan.sharded_grad is ShardedGrad.COPY and plan.input is Ownership.BORROWED
    assert plan_reduce(bucket, (layout,), ReduceFacts(True, True, True, all_reduce=True, offloaded=True)).sharded_grad is ShardedGrad.COPY


@pytest.mark.parametrize("param_device, mesh_device, accepted", [
    ("cpu", "cpu", True), ("meta", "cuda:0", True), ("cpu", "cuda:0", True),  # moved / materialized later
    ("cuda:0", "cuda:0", True), ("cuda:1", "cuda:0", False), ("cuda:0", "cpu", False),
])
def test_parameter_devices_fully_shard_accepts(param_device, mesh_device, accepted):
    """The device rule of fully_shard (its error path needs a second device type to reach end to end)."""
    from fullshard.torch.api import _device_accepted

    assert _device_accepted(torch.device(param_device), torch.device(mesh_device)) is accepted


# ----------------------------------------------------------------------------- exchange
@pytest.mark.parametrize("backend, device, size, expected", [
    ("gloo", "cpu", 2, Exchange.PAIRWISE),
    ("gloo", "cpu", MAX_PAIRWISE_RANKS, Exchange.PAIRWISE),
    ("gloo", "cpu", MAX_PAIRWISE_RANKS + 1, Exchange.COLLECTIVE),  # scratch would grow with N
    ("nccl", "cuda", 2, Exchange.COLLECTIVE),
    ("cpu:gloo,cuda:nccl", "cpu", 4, Exchange.PAIRWISE),
    ("cpu:gloo,cuda:nccl", "cuda", 4, Exchange.COLLECTIVE),
    ("gloo", "meta", 2, Exchange.COLLECTIVE),
    ("mpi", "cpu", 2, Exchange.COLLECTIVE),
])
def test_exchange_is_pairwise_only_for_cpu_tensors_on_gloo(backend, device, size, expected):
    assert choose_exchange(backend, device, size) is expected


def test_backend_string_is_read_per_device():
    assert backend_for_device("cpu:gloo,cuda:nccl", "cuda") == "nccl"
    assert backend_for_device("cuda:nccl", "cpu") == ""
    assert backend_for_device("gloo", "cpu") == "gloo"


def test_exchange_override_wins_and_bad_values_name_the_variable():
    assert choose_exchange("gloo", "cpu", 2, override="collective") is Exchange.COLLECTIVE
    assert choose_exchange("gloo", "cpu", 64, override=" Pairwise ") is Exchange.PAIRWISE
    with pytest.raises(ValueError, match="FULLSHARD_EXCHANGE='ring'.*'collective' or 'pairwise'"):
        choose_exchange("gloo", "cpu", 2, override="ring")
    # NCCL runs a pair's messages in issue order and has no tags: pairwise there would hang
    with pytest.raises(ValueError, match="FULLSHARD_EXCHANGE=pairwise needs CPU tensors on a gloo"):
        choose_exchange("nccl", "cuda", 2, override="pairwise")


@pytest.mark.parametrize("backend, device, override", [
    ("gloo", "cpu", None), ("nccl", "cuda", None), ("gloo", "cpu", "pairwise"), ("gloo", "cpu", "collective"),
])
def test_a_group_of_one_exchanges_nothing_whatever_is_asked(backend, device, override):
    assert choose_exchange(backend, device, 1, override=override) is Exchange.LOCAL
    with pytest.raises(ValueError, match="FULLSHARD_EXCHANGE='local'"):
        choose_exchange(backend, device, 1, override="local")  # not a choice: it follows from the group


def test_local_exchange_packs_into_the_output_and_keeps_narrow_gradients():
    layout = ShardLayout((8, 4), 0, 1)
    fused = plan_buckets([layout, layout], 1 << 20)[0]
    assert plan_gather(fused, (layout, layout), False, exchange=Exchange.LOCAL).packs_into_output
    assert wire_dtype(Exchange.LOCAL, "bfloat16", "float32") == "bfloat16"  # cast once, into the output


def test_per_rank_theory_is_the_formulas_together():
    theory = per_rank_theory(Strategy.OPTIM_GRADS_PARAMS, 4, 1000, 300, 100, compute_bytes=2, reduce_bytes=4,
                             micro_batches=3)
    assert theory["memory"] == peak_state_bytes(Strategy.OPTIM_GRADS_PARAMS, 4, 1000, 300, 4, 4, 8, 2)
    traffic = traffic_bytes_per_step(Strategy.OPTIM_GRADS_PARAMS, 4, 1000, 100, 2, 4)
    assert theory["traffic"] == {**traffic, "all_gather": 3 * traffic["all_gather"]}  # gathered per micro-batch
    assert theory["sent"] == bytes_sent_per_rank(theory["traffic"], 4)
    zero2 = per_rank_theory(Strategy.OPTIM_GRADS, 4, 1000, 300, micro_batches=3)
    assert zero2["traffic"]["all_gather"] == 4000  # kept across micro-batches: gathered once


def test_hsdp_replicas_add_the_all_reduce_of_each_gradient_shard():
    """(R replicas x S shards): memory is the S-rank formula; traffic adds one all-reduce of the reduced shard
    (num_params / S elements, in the replica reduce dtype) across R ranks, and the bytes it sends over R."""
    one_group = per_rank_theory(Strategy.OPTIM_GRADS_PARAMS, 4, 1000, 300, 100, reduce_bytes=2)
    hsdp = per_rank_theory(Strategy.OPTIM_GRADS_PARAMS, 4, 1000, 300, 100, reduce_bytes=2, replicas=3,
                           replica_reduce_bytes=4)
    assert hsdp["memory"] == one_group["memory"]
    assert hsdp["replica"] == {"all_reduce": 1000 * 4 / 4, "sent": 2 * (2 / 3) * 1000}
    assert hsdp["traffic"] == {**one_group["traffic"], "all_reduce": 1000.0}
    assert hsdp["sent"] == one_group["sent"] + 2 * (2 / 3) * 1000
    for strategy in Strategy:  # ZeRO-1/2/3 all sum their shards across replicas; no_shard already spans all
        theory = per_rank_theory(strategy, 4, 1000, 300, replicas=2)
        assert theory["replica"]["all_reduce"] == (0 if strategy is Strategy.NO_SHARD else 1000.0), strategy
    assert per_rank_theory(Strategy.OPTIM, 4, 1000, 300)["replica"] == {"all_reduce": 0.0, "sent": 0.0}


def test_pairwise_reduce_scatter_scratch():
    assert [reduce_scratch_chunks(Exchange.PAIRWISE, n) for n in (1, 2, 3, 4, 8)] == [0, 0, 1, 2, 6]
    assert reduce_scratch_chunks(Exchange.COLLECTIVE, 8) == 0


def test_exchange_tags_are_stable_and_distinct():
    label = "[layers.0.attn.weight] of module 'layers.0'"
    assert exchange_tag(label, "all_gather") == exchange_tag(label, "all_gather")  # no per-process salt
    tags = {exchange_tag(f"[layers.{i}.w] of module 'layers.{i}'", kind) for i in range(100) for kind in ("all_gather", "reduce_scatter")}
    assert len(tags) == 200 and all(0 <= t < 2**31 for t in tags)
    # a fixed value: a change of the hash would break ranks running different fullshard versions silently
    assert exchange_tag("x", "all_gather") == 0x1A38897E


def test_pairwise_gathers_pack_owned_inputs_into_the_output():
    even = ShardLayout((8, 4), 0, 2)
    fused = plan_buckets([even, even], 1 << 20)[0]
    single = plan_buckets([even], 0)[0]
    assert plan_gather(fused, (even, even), False, exchange=Exchange.PAIRWISE).packs_into_output
    assert plan_gather(single, (even,), True, exchange=Exchange.PAIRWISE).packs_into_output  # a cast
    assert not plan_gather(single, (even,), False, exchange=Exchange.PAIRWISE).packs_into_output  # borrowed: sent as is
    assert not plan_gather(fused, (even, even), False, exchange=Exchange.COLLECTIVE).packs_into_output


@pytest.mark.parametrize("world", [2, 4, 8])
def test_bytes_sent_are_the_bandwidth_optimal_share(world):
    zero3 = traffic_bytes_per_step(Strategy.OPTIM_GRADS_PARAMS, world, 1000, root_params=100)
    share = (world - 1) / world
    assert bytes_sent_per_rank(zero3, world) == pytest.approx(share * (1900 + 1000) * 4)
    ddp = traffic_bytes_per_step(Strategy.NO_SHARD, world, 1000)
    assert bytes_sent_per_rank(ddp, world) == pytest.approx(2 * share * 4000)


@pytest.mark.parametrize("exchange, grad, reduce, wire", [
    (Exchange.PAIRWISE, "bfloat16", "float32", "bfloat16"),  # widened exactly by the receiver: half the bytes
    (Exchange.PAIRWISE, "float16", "float32", "float16"),
    (Exchange.PAIRWISE, "float32", "float32", "float32"),
    (Exchange.PAIRWISE, "float32", "bfloat16", "bfloat16"),  # a narrower reduce dtype: cast before sending
    (Exchange.PAIRWISE, "bfloat16", "float16", "float16"),  # neither holds the other: the reduce dtype
    (Exchange.COLLECTIVE, "bfloat16", "float32", "float32"),  # a ring's partial sums need the reduce dtype
])
def test_gradients_travel_narrow_only_where_widening_is_exact(exchange, grad, reduce, wire):
    assert wire_dtype(exchange, grad, reduce) == wire


def test_widening_is_exact_for_every_pair_the_plan_allows():
    """The plan's table, checked with torch: every bf16/fp16 value survives the round trip through fp32."""
    from fullshard.plan.exchange import _CONVERTS_EXACTLY_INTO

    for narrow, wides in _CONVERTS_EXACTLY_INTO.items():
        values = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(getattr(torch, narrow)) \
            if narrow != "float32" else torch.randn(100_000)
        finite = values[torch.isfinite(values)]
        for wide in wides:
            assert torch.equal(finite.to(getattr(torch, wide)).to(finite.dtype), finite), (narrow, wide)
            assert DTYPE_BYTES[wide] >= 2 * DTYPE_BYTES[narrow]  # the receive fits in the output's upper half


def test_gradient_wire_bytes_follow_the_backend():
    assert gradient_wire_bytes(False, "gloo", "cpu", 2, "bfloat16", "float32") == 2
    assert gradient_wire_bytes(False, "nccl", "cuda", 2, "bfloat16", "float32") == 4
    assert gradient_wire_bytes(False, "gloo", "cpu", 16, "bfloat16", "float32") == 4  # gloo's ring above 8 ranks
    assert gradient_wire_bytes(False, "gloo", "cpu", 2, "bfloat16", "float32", override="collective") == 4
    assert gradient_wire_bytes(True, "gloo", "cpu", 2, "bfloat16", "float32") == 4  # no_shard all-reduces in fp32


def test_a_replica_is_borrowed_unless_computing_needs_a_copy():
    """no_shard: the replica computes as it is (whatever its tensor type) unless another dtype or device is
    needed; then an owned copy."""
    from fullshard.plan import Unsharded, plan_replica

    assert plan_replica(cast_needed=False) is Unsharded.REPLICA
    assert plan_replica(cast_needed=True) is Unsharded.OWN_STORAGE


@pytest.mark.parametrize("runtime, same_dtype, expected", [
    ("torch", True, "IN_AUTOGRAD"), ("torch", False, "OWNED"),
    ("torch 2.15", True, "IN_AUTOGRAD"), ("torch 2.15", False, "CONVERTED_IN_AUTOGRAD"),
    ("mindspore", True, "OWNED"), ("mindspore", False, "OWNED"),
])
def test_accumulation_stays_autograds_where_the_gradient_it_holds_can_sum_it(runtime, same_dtype, expected):
    """Autograd sums where its gradient already is in the reduce dtype, and where a parameter may hold a gradient
    of another dtype (torch 2.15) after one conversion; otherwise an owned accumulator (older torch casting,
    MindSpore whose autograd keeps nothing)."""
    from dataclasses import replace

    from fullshard.plan import MINDSPORE_RUNTIME, TORCH_RUNTIME, Accumulation, plan_accumulation

    facts = {"torch": TORCH_RUNTIME, "torch 2.15": replace(TORCH_RUNTIME, grads_in_any_dtype=True),
             "mindspore": MINDSPORE_RUNTIME}[runtime]
    assert plan_accumulation(same_dtype, facts) is Accumulation[expected]


def test_mesh_groups_split_by_mesh_and_divide_by_the_whole_call():
    """Expert parallelism: experts on an expert mesh of 2 (or 1) ranks, the rest on the call's 4; every group
    divides by 4, the data-parallel size of the call, however small its own mesh; groups keep first-appearance
    order and parameters keep theirs."""
    from fullshard.plan.exchange import MeshFacts, plan_mesh_groups

    dense, experts, alone = MeshFacts("dense", 4), MeshFacts("efsdp", 2), MeshFacts("efsdp1", 1)
    split = plan_mesh_groups(dense, [dense, experts, dense, experts, alone])
    assert split.members == ((0, 2), (1, 3), (4,))
    assert split.divide_factor == 4
    # the call's mesh counts even when no parameter is on it (an experts-only unit on the dense call mesh)
    assert plan_mesh_groups(dense, [experts, experts]).divide_factor == 4
    # HSDP counts replicas too: 2 x 2 covers the same 4 ranks
    assert plan_mesh_groups(MeshFacts("hsdp", 2, replicas=2), [experts]).divide_factor == 4
    # a wider parameter mesh than the call's wins (the call given the expert mesh, dense weights elsewhere)
    assert plan_mesh_groups(experts, [dense, experts]).divide_factor == 4
