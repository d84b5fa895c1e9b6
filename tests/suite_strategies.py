"""Strategy scenarios (issue 3): every strategy x precision x accumulation against the reference."""
from __future__ import annotations

import itertools

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from fullshard import MixedPrecisionPolicy
from fullshard.plan.strategy import Strategy
from fullshard.runtime.collectives import traffic
from tests.parity import build_gpt, mesh_1d, run_parity, shard_blocks_then_root

PRECISIONS = {
    "fp32": (MixedPrecisionPolicy(), dict(rtol=1e-5, atol=1e-6, param_atol=1e-5)),
    "bf16": (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        dict(rtol=2e-2, atol=2e-2, param_atol=3e-2),
    ),
}


def _parity(strategy: Strategy, precision: str, micro_batches: int):
    def scenario():
        mesh = mesh_1d()
        mp, tolerances = PRECISIONS[precision]
        result = run_parity(
            build_gpt,
            lambda m: shard_blocks_then_root(m, mesh=mesh, mp_policy=mp, strategy=strategy.value),
            micro_batches=micro_batches, global_batch=8, **tolerances,
        )
        return result.losses

    return scenario


def placements_follow_strategy():
    mesh = mesh_1d()
    for strategy, placement in [(Strategy.NO_SHARD, Replicate()), (Strategy.OPTIM, Shard(0))]:
        model = shard_blocks_then_root(build_gpt(), mesh=mesh, strategy=strategy.value)
        for name, param in model.named_parameters():
            assert isinstance(param, DTensor) and param.placements == (placement,), (strategy, name)
        model(torch.randint(0, 64, (2, 16))).sum().backward()
        for name, param in model.named_parameters():
            assert param.grad.placements == (placement,), (strategy, name)
    return True


def collectives_follow_strategy():
    """ZeRO-3 gathers twice, ZeRO-1/2 once (kept, refreshed next step), no_shard only all-reduces."""
    mesh = mesh_1d()
    counts = {}
    for strategy in Strategy:
        model = shard_blocks_then_root(build_gpt(), mesh=mesh, strategy=strategy.value)
        tokens = torch.randint(0, 64, (2, 16))
        for _ in range(2):  # the second step shows the steady state
            traffic.clear()
            model(tokens).sum().backward()
        counts[strategy.value] = dict(traffic)
    numel = sum(p.numel() for p in build_gpt().parameters())
    zero3, zero2 = counts["optim_grads_params"], counts["optim_grads"]
    assert counts["no_shard"].get("all_gather", 0) == 0 and counts["no_shard"]["all_reduce"] >= 4 * numel
    assert zero2["all_gather"] < zero3["all_gather"] < 2 * zero2["all_gather"], counts
    assert counts["optim"]["all_gather"] == zero2["all_gather"], counts
    assert zero3["reduce_scatter"] == zero2["reduce_scatter"] == counts["optim"]["reduce_scatter"], counts
    return counts


def suite():
    scenarios = {"placements_follow_strategy": placements_follow_strategy,
                 "collectives_follow_strategy": collectives_follow_strategy}
    for strategy, precision, micro in itertools.product(Strategy, PRECISIONS, (1, 4)):
        scenarios[f"parity_{strategy.value}_{precision}_accum{micro}"] = _parity(strategy, precision, micro)
    return scenarios
