"""The small valid checkpoint the torch fuzz test mutates, saved by 2 gloo ranks (tests/test_checkpoint_fuzz.py).

A two-layer MLP sharded with fullshard (Shard(0), uneven: 5 rows on 2 ranks)
and its AdamW state after one step, saved with ``save_checkpoint`` under
``$FULLSHARD_TEST_CKPT/fuzz/step_1``; rank 0 also writes the full state
(``expected_fuzz.pt``) the fuzz test's positive control compares with.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from fullshard import fully_shard
from fullshard.checkpoint import step_dir
from fullshard.torch.checkpoint import save_checkpoint

STEP = 1


def mlp(seed: int) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))


def sharded_and_trained(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The MLP sharded by layer and at the root, after one AdamW step (on any world size)."""
    model = mlp(seed)
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = torch.randn(4, 6, generator=torch.Generator().manual_seed(seed))
    model(batch).square().sum().backward()
    optim.step()
    optim.zero_grad()
    return model, optim


def save_fuzz_checkpoint():
    root = Path(os.environ["FULLSHARD_TEST_CKPT"])
    model, optim = sharded_and_trained(0)
    save_checkpoint(model, step_dir(root / "fuzz", STEP), optim)
    model_sd, optim_sd = get_state_dict(model, optim, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        torch.save({"model": model_sd, "optim": optim_sd}, root / "expected_fuzz.pt")
    dist.barrier()
    return sorted(p.name for p in (root / "fuzz" / f"step_{STEP}").iterdir())


def suite() -> dict[str, Callable[[], Any]]:
    return {"save_fuzz_checkpoint": save_fuzz_checkpoint}
