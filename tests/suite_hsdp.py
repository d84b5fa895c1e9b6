"""HSDP scenarios (issue 3) on 4 gloo ranks: a 2x2 (replicate, shard) mesh against the reference."""
from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from fullshard import MixedPrecisionPolicy
from fullshard.accounting import reset_traffic, traffic_bytes
from tests.parity import build_gpt, gpt_batch, gpt_loss, run_parity, shard_blocks_then_root


def mesh_2x2():
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))


def hsdp_parity():
    mesh = mesh_2x2()
    return run_parity(build_gpt, lambda m: shard_blocks_then_root(m, mesh=mesh)).losses


def hsdp_parity_bf16_dim1():
    mesh = mesh_2x2()
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return run_parity(
        build_gpt,
        lambda m: shard_blocks_then_root(m, mesh=mesh, mp_policy=mp, shard_placement_fn=lambda p: Shard(p.dim() - 1)),
        rtol=2e-2, atol=2e-2, param_atol=3e-2,
    ).losses


def hsdp_placements():
    model = shard_blocks_then_root(build_gpt(), mesh=mesh_2x2())
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor) and param.placements == (Replicate(), Shard(0)), name
    return True


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


def suite():
    return {fn.__name__: fn for fn in [hsdp_placements, hsdp_parity, hsdp_parity_bf16_dim1, hsdp_accumulate_without_all_reduce]}
