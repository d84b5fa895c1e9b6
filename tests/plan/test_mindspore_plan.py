"""What the planning code learned for the MindSpore runtime (no framework needed: pure functions)."""
import subprocess
import sys

import pytest

from fullshard.plan import (
    ReduceFacts,
    MINDSPORE_RUNTIME,
    TORCH_RUNTIME,
    Exchange,
    Ownership,
    ShardedGrad,
    ShardLayout,
    Unsharded,
    choose_exchange,
    plan_buckets,
    plan_gather,
    plan_reduce,
)
from fullshard.plan.formulas import carried_traffic, bytes_sent_per_rank, peak_state_bytes, per_rank_theory
from fullshard.plan.exchange import (
    HCCL, MCCL, Collectives, backend_named, carrier_dtype, choose_collectives, is_bit_cast,
)
from fullshard.plan.group import Strategy, lifecycle


def _lone(layout):
    return plan_buckets([layout], 0)[0]


@pytest.mark.parametrize(
    "shape, dim, cast, torch_input, mindspore_input",
    [
        ((8, 4), 0, False, Ownership.BORROWED, Ownership.BORROWED),  # even dim 0: the shard is the chunk
        ((7, 4), 0, False, Ownership.BORROWED, Ownership.OWNED),  # torch keeps a padded chunk behind; MindSpore not
        ((4, 8), 1, False, Ownership.BORROWED, Ownership.BORROWED),  # even dim 1: local shape = chunk shape
        ((4, 9), 1, False, Ownership.OWNED, Ownership.OWNED),  # padded, interleaved
        ((8, 4), 0, True, Ownership.OWNED, Ownership.OWNED),  # a cast allocates
    ],
)
def test_gather_input_follows_what_the_runtime_keeps_behind_a_shard(shape, dim, cast, torch_input, mindspore_input):
    layout = ShardLayout(shape, dim, 2)
    assert plan_gather(_lone(layout), (layout,), cast).input is torch_input
    assert plan_gather(_lone(layout), (layout,), cast, runtime=TORCH_RUNTIME).input is torch_input
    plan = plan_gather(_lone(layout), (layout,), cast, runtime=MINDSPORE_RUNTIME)
    assert plan.input is mindspore_input and plan.output is Ownership.OWNED


def test_out_of_place_collectives_never_pack_into_an_output():
    layout = ShardLayout((7, 4), 0, 2)
    for exchange in (Exchange.LOCAL, Exchange.PAIRWISE):
        assert plan_gather(_lone(layout), (layout,), True, exchange).packs_into_output
        assert not plan_gather(_lone(layout), (layout,), True, exchange, MINDSPORE_RUNTIME).packs_into_output


@pytest.mark.parametrize(
    "shape, dim, bit_cast, torch_kind, mindspore_kind",
    [
        ((8, 4), 0, False, Unsharded.VIEW_OF_OUTPUT, Unsharded.OUTPUT),  # gathered straight into its shape
        ((7, 4), 0, False, Unsharded.VIEW_OF_OUTPUT, Unsharded.OWN_STORAGE),  # padding: a slice would be a view
        ((8, 4), 0, True, Unsharded.VIEW_OF_OUTPUT, Unsharded.OWN_STORAGE),  # bf16 read back from fp16 bits: a view
        ((1, 8), 1, False, Unsharded.VIEW_OF_OUTPUT, Unsharded.OWN_STORAGE),  # prefix, but not along dim 0
        ((4, 9), 1, False, Unsharded.OWN_STORAGE, Unsharded.OWN_STORAGE),
    ],
)
def test_mindspore_never_hands_out_a_view_it_must_reclaim(shape, dim, bit_cast, torch_kind, mindspore_kind):
    """A view given to MindSpore's autograd keeps its data alive whatever is resized (test_mindspore_facts)."""
    layout = ShardLayout(shape, dim, 2)
    assert plan_gather(_lone(layout), (layout,), False).unsharded is torch_kind
    assert plan_gather(_lone(layout), (layout,), False, runtime=MINDSPORE_RUNTIME, bit_cast=bit_cast).unsharded \
        is mindspore_kind


def test_fused_buckets_copy_out_on_mindspore():
    even = ShardLayout((8, 4), 0, 2)
    fused = plan_buckets([even, even], 1 << 20)[0]
    plan = plan_gather(fused, (even, even), False, runtime=MINDSPORE_RUNTIME)
    assert (plan.input, plan.unsharded) == (Ownership.OWNED, Unsharded.OWN_STORAGE)


def test_an_out_of_place_all_reduce_may_borrow_the_gradient():
    """torch's all-reduce writes its input, so it always packs a copy; MindSpore's only reads it."""
    replica = ShardLayout((7, 4), 0, 1)
    bucket = _lone(replica)
    assert plan_reduce(bucket, (replica,), ReduceFacts(True, True, True, all_reduce=True)).input is Ownership.OWNED
    plan = plan_reduce(bucket, (replica,), ReduceFacts(True, True, True, all_reduce=True), runtime=MINDSPORE_RUNTIME)
    assert plan.input is Ownership.BORROWED
    # another dtype, or a strided gradient, still packs
    assert plan_reduce(bucket, (replica,), ReduceFacts(False, True, True, all_reduce=True), runtime=MINDSPORE_RUNTIME).input is Ownership.OWNED
    assert plan_reduce(bucket, (replica,), ReduceFacts(True, False, True, all_reduce=True), runtime=MINDSPORE_RUNTIME).input is Ownership.OWNED


@pytest.mark.parametrize(
    "exchange, divides, sharded_grad",
    [
        (Exchange.ALL_REDUCE_CHUNK, False, ShardedGrad.COPY),  # a view would keep the whole summed buffer alive
        (Exchange.ALL_REDUCE_CHUNK, True, ShardedGrad.COPY),
        (Exchange.COLLECTIVE, True, ShardedGrad.COPY),  # division out of place: a new tensor
        (Exchange.COLLECTIVE, False, ShardedGrad.VIEW_OF_OUTPUT),  # a sum, on a real reduce-scatter: zero copy
    ],
)
def test_mindspore_sharded_gradient_is_a_view_only_where_nothing_must_change(exchange, divides, sharded_grad):
    layout = ShardLayout((8, 4), 0, 2)
    plan = plan_reduce(_lone(layout), (layout,), ReduceFacts(True, True, True, exchange=exchange, divides=divides), runtime=MINDSPORE_RUNTIME)
    assert plan.sharded_grad is sharded_grad
    assert plan.input is Ownership.BORROWED  # the seed's zero-copy case holds on the emulation too


def test_torch_reduce_plan_ignores_the_new_facts():
    layout = ShardLayout((8, 4), 0, 2)
    for exchange in Exchange:
        plan = plan_reduce(_lone(layout), (layout,), ReduceFacts(True, True, True, exchange=exchange, divides=True))
        assert plan.sharded_grad is ShardedGrad.VIEW_OF_OUTPUT or exchange is Exchange.ALL_REDUCE_CHUNK


def test_capability_table_chooses_emulations_only_where_collectives_are_missing():
    assert choose_collectives(MCCL, 2, group_is_world=True) == Collectives(Exchange.COLLECTIVE, Exchange.ALL_REDUCE_CHUNK)
    assert choose_collectives(MCCL, 2, group_is_world=False) == Collectives(
        Exchange.ZERO_FILLED_ALL_REDUCE, Exchange.ALL_REDUCE_CHUNK
    )
    assert choose_collectives(HCCL, 2, group_is_world=False) == Collectives(Exchange.COLLECTIVE, Exchange.COLLECTIVE)
    assert choose_collectives(MCCL, 1, group_is_world=True) == Collectives(Exchange.LOCAL, Exchange.LOCAL)
    assert choose_collectives(MCCL, 2, True).emulated and not choose_collectives(HCCL, 2, True).emulated
    assert backend_named("mccl") is MCCL
    with pytest.raises(ValueError, match="'gloo'.*known: hccl, mccl"):
        backend_named("gloo")


def test_bfloat16_travels_as_float16_bits_when_moved_and_widened_when_summed():
    assert carrier_dtype(MCCL, "bfloat16", summed=False) == "float16"
    assert is_bit_cast("bfloat16", "float16")
    assert carrier_dtype(MCCL, "bfloat16", summed=True) == "float32"
    assert not is_bit_cast("bfloat16", "float32")
    assert carrier_dtype(MCCL, "float32", summed=True) == "float32"
    assert carrier_dtype(MCCL, "float16", summed=True) == "float16"
    assert carrier_dtype(HCCL, "bfloat16", summed=True) == "bfloat16"
    with pytest.raises(ValueError, match="cannot sum float64"):
        carrier_dtype(MCCL, "float64", summed=True)


def test_emulations_are_counted_as_what_they_are_and_cost_twice_the_minimum():
    """An all-reduce sends 2(N-1)/N of its buffer; the reduce-scatter it stands for, (N-1)/N."""
    theory = per_rank_theory(Strategy.OPTIM_GRADS_PARAMS, 2, 1000, 400, 100)["traffic"]
    carried = carried_traffic(theory, choose_collectives(MCCL, 2, True))
    assert carried == {"all_gather": theory["all_gather"], "reduce_scatter": 0.0, "all_reduce": theory["reduce_scatter"]}
    minimum = bytes_sent_per_rank({"reduce_scatter": theory["reduce_scatter"]}, 2)
    assert bytes_sent_per_rank({"all_reduce": carried["all_reduce"]}, 2) == 2 * minimum
    hsdp = carried_traffic(theory, choose_collectives(MCCL, 2, False), replica_payload=50.0)
    assert hsdp["all_gather"] == 0 and hsdp["all_reduce"] == theory["all_gather"] + theory["reduce_scatter"] + 50.0
    assert carried_traffic(theory, choose_collectives(HCCL, 2, False)) == {**theory, "all_reduce": 0.0}
    assert carried_traffic(theory, choose_collectives(MCCL, 1, True), replica_payload=8.0)["all_reduce"] == 8.0


def test_zero1_reduces_once_at_the_end_of_backward_with_dp_gradient_memory():
    """ZeRO-1 keeps unsharded gradients until the end of backward on every runtime (MindSpore's bprops return
    placeholders filled then), so its gradients take DP's memory, as the formula says."""
    assert lifecycle(Strategy.OPTIM, False).reduce_at_end_of_backward
    assert not lifecycle(Strategy.OPTIM_GRADS, False).reduce_at_end_of_backward
    zero1, zero2 = peak_state_bytes(Strategy.OPTIM, 4, 1000, 100), peak_state_bytes(Strategy.OPTIM_GRADS, 4, 1000, 100)
    assert zero1["grads"] == 4000 and zero2["grads"] == 1000
    assert zero1["params"] == zero2["params"] and zero1["optim"] == zero2["optim"]


def test_emulations_are_not_exchange_overrides():
    for name in ("all_reduce_chunk", "zero_filled_all_reduce", "local"):
        with pytest.raises(ValueError, match="FULLSHARD_EXCHANGE"):
            choose_exchange("gloo", "cpu", 2, override=name)


def test_plan_imports_no_framework():
    code = ("import sys, fullshard.plan, fullshard.plan.exchange, fullshard.core.buffers, fullshard.core.trees; "
            "bad = {'torch', 'mindspore'} & set(sys.modules); assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
