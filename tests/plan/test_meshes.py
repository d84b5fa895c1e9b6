"""The per-mesh formulas (fullshard/plan/meshes.py): an MoE's dense weights on the dense mesh, its experts on
their own, each mesh a ZeRO model of its own; checked against the one-mesh formulas and by hand."""
import pytest

from fullshard.plan.formulas import per_rank_theory
from fullshard.plan.group import Strategy
from fullshard.plan.meshes import MeshShare, mesh_theory, moe_shares, token_exchange_bytes

DENSE, ROOT, EXPERTS = [300, 300], 500, [800, 800]  # per layer; the root's own (dense) parameters
SHARDING = [Strategy.OPTIM, Strategy.OPTIM_GRADS, Strategy.OPTIM_GRADS_PARAMS]


@pytest.mark.parametrize("strategy", list(Strategy))
def test_without_expert_parallelism_the_meshes_add_up_to_the_one_mesh_formulas(strategy):
    """ep 1: the experts shard over every rank, as the dense weights do: the sum over the two meshes is the
    whole model's figures (each layer's groups gather together: the largest unit is a layer's two parts)."""
    theory = mesh_theory(strategy, 4, moe_shares(DENSE, ROOT, EXPERTS, 1), compute_bytes=2, reduce_bytes=4)
    whole = per_rank_theory(strategy, 4, sum(DENSE) + ROOT + sum(EXPERTS), 300 + 800, ROOT, compute_bytes=2)
    total = theory["total"]
    assert total["num_params"] == sum(DENSE) + ROOT + sum(EXPERTS)
    for key in ("params", "grads", "optim", "total"):
        # the sum counts the largest dense unit (the root, 500) with the largest experts (800): 200 more
        extra = 200 * (2 + 4) if key == "total" and strategy is Strategy.OPTIM_GRADS_PARAMS else 0
        assert total["memory"][key] == pytest.approx(whole["memory"][key] + extra), key
    assert total["traffic"] == pytest.approx(whole["traffic"]) and total["sent"] == pytest.approx(whole["sent"])
    assert [m["role"] for m in theory["meshes"]] == ["dense", "experts"]
    assert [m["shards"] for m in theory["meshes"]] == [4, 4]


def test_expert_parallel_experts_shard_over_their_own_mesh_by_hand():
    """ep 2 on 4 ranks, ZeRO-3, fp32 Adam: a rank's ep group holds half the experts (800 of 1600), sharded
    over efsdp's 2 ranks; the dense weights (1100) over all 4."""
    theory = mesh_theory(Strategy.OPTIM_GRADS_PARAMS, 4, moe_shares(DENSE, ROOT, EXPERTS, 2))
    dense, experts = theory["meshes"]
    assert (dense["shards"], dense["num_params"]) == (4, 1100)
    assert (experts["shards"], experts["num_params"]) == (2, 800)
    assert experts["memory"]["params"] == 800 * 4 / 2 and experts["memory"]["optim"] == 800 * 8 / 2
    assert experts["memory"]["unsharded"] == 400 * (4 + 4)  # one layer's experts: 800 / ep, params + grads
    # ZeRO-3 gathers every layer's experts twice (forward, backward) and reduces them once, over efsdp
    assert experts["traffic"] == {"all_gather": 2 * 800 * 4, "reduce_scatter": 800 * 4, "all_reduce": 0.0}
    assert experts["sent"] == pytest.approx((2 * 800 * 4 + 800 * 4) / 2)  # (S-1)/S of it over S = 2
    assert dense["traffic"]["all_gather"] == (1100 + 600) * 4  # the root is gathered once
    assert theory["total"]["traffic"]["all_gather"] == (1100 + 600 + 1600) * 4
    assert theory["total"]["memory"]["params"] == 1100 * 4 / 4 + 800 * 4 / 2


@pytest.mark.parametrize("strategy", SHARDING)
def test_an_expert_mesh_of_one_rank_moves_nothing_and_holds_its_experts_whole(strategy):
    """ep 2 on 2 ranks: efsdp has one rank, so the experts are neither gathered nor reduced by FSDP."""
    experts = mesh_theory(strategy, 2, moe_shares(DENSE, ROOT, EXPERTS, 2))["meshes"][1]
    assert experts["shards"] == 1 and set(experts["traffic"].values()) == {0.0} and experts["sent"] == 0
    assert experts["memory"]["params"] == 800 * 4 and experts["memory"]["grads"] == 800 * 4


@pytest.mark.parametrize("strategy", SHARDING)
def test_zero_1_2_and_hsdp_per_mesh(strategy):
    """ZeRO-1/2 gather once and keep the whole mesh unsharded; with HSDP every mesh's reduced shard is also
    summed across the replicas (in ``replica_reduce_bytes``)."""
    theory = mesh_theory(strategy, 4, moe_shares(DENSE, ROOT, EXPERTS, 2), replicas=3, reduce_bytes=2,
                         replica_reduce_bytes=4)
    for mesh in theory["meshes"]:
        alone = per_rank_theory(strategy, mesh["shards"], mesh["num_params"],
                                max(DENSE + [ROOT]) if mesh["role"] == "dense" else 400,
                                ROOT if mesh["role"] == "dense" else 0, reduce_bytes=2, replicas=3,
                                replica_reduce_bytes=4)
        assert mesh["memory"] == alone["memory"] and mesh["traffic"] == alone["traffic"]
        assert mesh["replica"]["all_reduce"] == mesh["num_params"] * 4 / mesh["shards"]
    experts = theory["meshes"][1]
    if strategy is not Strategy.OPTIM_GRADS_PARAMS:
        assert experts["memory"]["unsharded"] == 800 * 4 and experts["traffic"]["all_gather"] == 800 * 4


def test_the_wire_dtype_may_depend_on_the_mesh_size():
    """gloo's pairwise exchange carries bf16 gradients as bf16, a group of one moves nothing: the gradient
    bytes are asked per mesh size."""
    asked = []
    mesh_theory(Strategy.OPTIM_GRADS_PARAMS, 4, moe_shares(DENSE, ROOT, EXPERTS, 4),
                reduce_bytes=lambda shards: asked.append(shards) or 2)
    assert asked == [4, 1]


def test_token_exchange_by_hand():
    """2 MoE layers, 32 tokens per rank, top-2, width 64, fp32, 4 experts, 2 micro-batches: four buffers of
    32 * 2 * 64 floats per layer, and the routing counts (4 int64) per layer and micro-batch."""
    assert token_exchange_bytes(2, 2, 32, 2, 64, 4, 4, micro_batches=2) == 2 * (4 * 32 * 2 * 64 * 4 + 2 * 4 * 8)
    assert token_exchange_bytes(1, 2, 32, 2, 64, 4, 4) == 0.0


def test_bad_splits_are_refused_naming_the_role():
    with pytest.raises(ValueError, match="'experts': 801 parameters do not split over 2"):
        MeshShare("experts", (801,), 0, 2)
    with pytest.raises(ValueError, match="experts: 6 ranks do not divide into expert-parallel groups of 4"):
        mesh_theory(Strategy.OPTIM_GRADS_PARAMS, 6, moe_shares(DENSE, ROOT, EXPERTS, 4))
