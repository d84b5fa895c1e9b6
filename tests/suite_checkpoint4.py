"""Checkpoint scenarios on 4 gloo ranks: the world size changes between save and load.

Run by tests/test_checkpoint.py after the 2-rank suite (tests/suite_checkpoint.py)
has saved ``ws2/step_2`` and ``expected_ws2.pt`` under ``$FULLSHARD_TEST_CKPT``.
"""
from __future__ import annotations

from typing import Any, Callable

import torch.distributed as dist
from torch.distributed.tensor import Shard

from fullshard.checkpoint import step_dir
from fullshard.torch.checkpoint import load_checkpoint, save_checkpoint
from tests.suite_checkpoint import (
    CFG,
    adamw,
    assert_matches_expected,
    ckpt_root,
    shard_last_dim,
    sharded,
    train,
    write_expected,
)


def load_world_size_2_at_4():
    """Saved at 2 ranks (Shard(0): 34 + 33 rows), loaded at 4 (17 * 3 + 16 rows): identical model and AdamW state."""
    model = sharded(5)
    optim = adamw(model)
    load_checkpoint(model, step_dir(ckpt_root() / "ws2", 2), optim)
    rows = model.wte.weight.to_local().shape[0]
    assert rows == (16 if dist.get_rank() == 3 else 17), f"rank {dist.get_rank()} holds {rows} rows of 67"
    assert_matches_expected(model, optim, "expected_ws2.pt")


def load_world_size_2_at_4_shard_last_dim():
    model = sharded(6, shard_placement_fn=shard_last_dim)
    optim = adamw(model)
    load_checkpoint(model, step_dir(ckpt_root() / "ws2", 2), optim)
    for name, param in model.named_parameters():
        assert param.placements == (Shard(param.dim() - 1),), name
    assert_matches_expected(model, optim, "expected_ws2.pt")


def save_world_size_4():
    """Train one more step at 4 ranks and save: the single-process tests load this one at world size 1."""
    model = sharded(5)
    optim = adamw(model)
    load_checkpoint(model, step_dir(ckpt_root() / "ws2", 2), optim)
    losses = train(model, optim, range(2, 3))
    save_checkpoint(model, step_dir(ckpt_root() / "ws4", 3), optim)
    write_expected(model, optim, "expected_ws4.pt")
    return {"losses": losses, "vocab": CFG.vocab_size}


def suite() -> dict[str, Callable[[], Any]]:
    return {fn.__name__: fn for fn in (load_world_size_2_at_4, load_world_size_2_at_4_shard_last_dim, save_world_size_4)}
