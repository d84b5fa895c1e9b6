"""HSDP scenarios (issue 3) on 4 gloo ranks: a 2x2 (replicate, shard) mesh against the reference."""
from __future__ import annotations

import gc

import torch.distributed as dist

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from fullshard import MixedPrecisionPolicy
from fullshard.torch.accounting import reset_traffic, traffic_bytes
from tests.conftest import Launch, scenario
from tests.torch.parity import build_gpt, gpt_batch, gpt_loss, run_parity, shard_blocks_then_root

LAUNCH = Launch(world_sizes=(4,))


def mesh_2x2():
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))


@scenario
def hsdp_parity():
    mesh = mesh_2x2()
    return run_parity(build_gpt, lambda m: shard_blocks_then_root(m, mesh=mesh)).losses


@scenario
def hsdp_parity_bf16_dim1():
    mesh = mesh_2x2()
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return run_parity(
        build_gpt,
        lambda m: shard_blocks_then_root(m, mesh=mesh, mp_policy=mp, shard_placement_fn=lambda p: Shard(p.dim() - 1)),
        rtol=2e-2, atol=2e-2, param_atol=3e-2,
    ).losses


@scenario
def hsdp_placements():
    model = shard_blocks_then_root(build_gpt(), mesh=mesh_2x2())
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor) and param.placements == (Replicate(), Shard(0)), name
    return True


@scenario
def hsdp_accumulate_without_all_reduce():
    """Non-final micro-batches skip the replica all-reduce; partial sums wait in owned buffers."""
    mesh = mesh_2x2()
    run_parity(build_gpt, lambda m: shard_blocks_then_root(m, mesh=mesh), micro_batches=4, global_batch=16,
               defer="all_reduce")
    model = shard_blocks_then_root(build_gpt(), mesh=mesh)
    counts = []
    for index in range(3):
        model.set_requires_all_reduce(index == 2)
        reset_traffic()
        gpt_loss(model, gpt_batch(index, 2)).backward()
        counts.append(traffic_bytes())
    assert counts[0]["all_reduce"] == counts[1]["all_reduce"] == 0, counts
    assert counts[2]["all_reduce"] > 0 and all(c["reduce_scatter"] > 0 for c in counts), counts
    return counts


@scenario
def hsdp_traffic_is_the_formula():
    """memory_report's theory counts HSDP's replica all-reduce: on a 2x2 and on a 4x1 mesh (replicas differ
    from shards), each kind's measured bytes of a step equal the formula's, the all-reduce exactly each
    rank's gradient shard (the tiny GPT's dims divide by 2: no padding). The meter counts all of it, the
    replicas' all-reduce too, for the one mesh the groups shard and replicate over."""
    from fullshard.torch.accounting import memory_report, mesh_params, traffic_by_mesh

    figures = {}
    for replicas, shards in ((2, 2), (4, 1)):
        mesh = init_device_mesh("cpu", (replicas, shards), mesh_dim_names=("replicate", "shard"))
        torch.manual_seed(0)
        model = shard_blocks_then_root(build_gpt(), mesh=mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for step in range(2):  # the second step is the steady state
            reset_traffic()
            gpt_loss(model, gpt_batch(step, 2)).backward()
            report = memory_report(model, optimizer)
            optimizer.step()
            optimizer.zero_grad()
        theory = report["theory"]["traffic"]
        assert report["traffic"] == {k: int(v) for k, v in theory.items()}, (replicas, shards, report)
        (key, mesh), = mesh_params(model).items()
        assert (mesh["shards"], mesh["replicas"], len(mesh["params"])) == (shards, replicas, len(list(model.parameters())))
        assert traffic_by_mesh() == {key: report["traffic"]}, traffic_by_mesh()
        num_params = sum(p.numel() for p in model.parameters())
        # fp32 shards, summed across replicas, with the reductions' presence counts (plan.group.plan_presence)
        presence = sum(g.plan.presence_numel for m in model.modules() if hasattr(m, "_fullshard_unit")
                       for g in m._fullshard_unit.groups)
        assert theory["all_reduce"] == num_params * 4 / shards + presence * 4, theory
        figures[f"{replicas}x{shards}"] = {"measured": report["traffic"], "theory": theory}
    return figures


@scenario
def reshard_after_forward_to_smaller_group():
    """reshard_after_forward=2 on 4 ranks: backward all-gathers within pairs, from half-size kept chunks."""
    import fullshard.torch.collectives as collectives
    from fullshard.torch.collectives import comm_bytes
    from tests.torch.parity import mesh_1d

    mesh = mesh_1d()
    run_parity(build_gpt, lambda m: shard_blocks_then_root(m, mesh=mesh, reshard_after_forward=2))
    run_parity(build_gpt, lambda m: shard_blocks_then_root(m, mesh=mesh, reshard_after_forward=2),
               micro_batches=2, global_batch=8)
    sizes, original = [], collectives.all_gather

    def recording(kind, out, inp, group, *args, **kwargs):
        sizes.append(dist.get_world_size(group))
        return original(kind, out, inp, group, *args, **kwargs)

    gc.collect()
    model = shard_blocks_then_root(build_gpt(), mesh=mesh, reshard_after_forward=2)
    collectives.all_gather = recording
    try:
        before = comm_bytes()["live"]
        loss = gpt_loss(model, gpt_batch(0, 4))
        kept = comm_bytes()["live"] - before
        forward_sizes, sizes[:] = list(sizes), []
        loss.backward()
    finally:
        collectives.all_gather = original
    full_bytes = sum(p.numel() * 4 for p in model.parameters())
    assert set(forward_sizes) == {4} and set(sizes) == {2}, (forward_sizes, sizes)
    # every unit (the root too: the int was passed to it explicitly) keeps the chunks of 2 of 4 ranks
    assert kept == full_bytes // 2, (kept, full_bytes)
    return {"forward_group_sizes": forward_sizes, "backward_group_sizes": sizes, "kept_bytes": kept}


EXTRA = [reshard_after_forward_to_smaller_group]
