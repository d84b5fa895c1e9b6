"""Meta-device initialization (issue 5) on 2 and 4 gloo ranks: per-rank memory and values that do not depend on
the world size (1 rank: the unsharded reference)."""
from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from fullshard.torch.materialize import materialize
from tests.conftest import Launch, scenario
from tests.torch.parity import build_gpt, gpt_batch, gpt_loss, mesh_1d, shard_blocks_then_root

LAUNCH = Launch(world_sizes=(2, 4))


def _meta_sharded_gpt():
    with torch.device("meta"):
        model = build_gpt()
    return shard_blocks_then_root(model, mesh=mesh_1d())


@scenario
def same_full_parameters_as_unsharded_init():
    """The same seed gives the same full parameters at N = 1 (plain model) and at this world size."""
    model = _meta_sharded_gpt()
    assert all(p.is_meta for p in model.parameters())
    materialize(model, device="cpu", seed=7)
    reference = build_gpt()
    materialize(reference, seed=7)
    for (name, param), ref in zip(model.named_parameters(), reference.parameters()):
        assert isinstance(param, DTensor) and not param.to_local().is_meta, name
        assert torch.equal(param.full_tensor(), ref), name
    return True


@scenario
def no_rank_holds_the_full_model():
    model = _meta_sharded_gpt()
    full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    stats = materialize(model, device="cpu", seed=7)
    shard_bytes = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    world = mesh_1d().size()
    # a budget the full model does not fit in: its 1/N share plus one module, with 10% slack
    budget = 1.1 * (full_bytes / world + stats["peak_full_bytes"])
    assert full_bytes > budget, "choose a larger world size: the model would fit"
    assert shard_bytes + stats["peak_full_bytes"] <= budget, (shard_bytes, stats, budget)
    # and it trains
    loss = gpt_loss(model, gpt_batch(0, 2))
    loss.backward()
    assert torch.isfinite(loss)
    return {"full_bytes": full_bytes, "shard_bytes": shard_bytes, **stats}


@scenario
def to_empty_then_own_init_works():
    """The plain PyTorch flow: to_empty, then the model's own init, then training."""
    model = _meta_sharded_gpt()
    model.to_empty(device="cpu")
    model.reset_parameters()
    assert all(not p.to_local().is_meta for p in model.parameters())
    assert model.lm_head.weight is model.wte.weight
    gpt_loss(model, gpt_batch(0, 2)).backward()
    assert all(p.grad is not None for p in model.parameters())
    return True
