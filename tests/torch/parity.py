"""Parity of a sharded model against a single-process reference, run inside each rank.

Every rank builds the same model from the same seed. The default optimizer is
SGD with momentum: Adam divides by the gradient's own magnitude, so on
parameters whose exact gradient is zero (attention key biases) it turns
rounding noise into full-size steps and parity would measure noise. The reference copy is
trained on the whole global batch in this process (no communication); the
sharded copy on this rank's slice. Losses (averaged across ranks) and final
full parameters must match.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from fullshard.models.gpt import GPT, GPTConfig

TINY_GPT = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=4)


def mesh_1d():
    return init_device_mesh("cpu", (dist.get_world_size(),))


def gpt_batch(step: int, batch: int, cfg: GPTConfig = TINY_GPT) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def gpt_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    tokens, targets = batch
    logits = model(tokens)
    return nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


class TorchLayersLM(nn.Module):
    """A small transformer from torch's own layers (TransformerEncoderLayer)."""

    def __init__(self, vocab: int = 64, width: int = 32, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(width, nhead=4, dim_feedforward=2 * width, dropout=0.0, batch_first=True)
            for _ in range(layers)
        )
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def build_gpt(cfg: GPTConfig = TINY_GPT) -> nn.Module:
    return GPT(cfg)


def shard_blocks_then_root(model: nn.Module, **kwargs) -> nn.Module:
    """The canonical wrapping: every block, then the root."""
    from fullshard import fully_shard

    for layer in model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


@dataclass
class ParityResult:
    losses: list[float] = field(default_factory=list)
    ref_losses: list[float] = field(default_factory=list)
    max_param_diff: float = 0.0


def run_parity(
    build: Callable[[], nn.Module],
    wrap: Callable[[nn.Module], nn.Module],
    *,
    steps: int = 4,
    global_batch: int = 4,
    make_batch: Callable[[int, int], tuple] = gpt_batch,
    loss_fn: Callable[[nn.Module, tuple], torch.Tensor] = gpt_loss,
    micro_batches: int = 1,
    defer: str = "gradient_sync",
    clip: Optional[float] = None,
    rtol: float = 1e-5,
    atol: float = 1e-6,
    param_atol: float = 1e-5,
    optimizer: Callable = lambda params: torch.optim.SGD(params, lr=0.5, momentum=0.9),
    ref_dtype: Optional[torch.dtype] = None,
    seed: int = 0,
    finish: Optional[Callable[[nn.Module], None]] = None,
) -> ParityResult:
    """``finish(model)``: called after each step's backward passes, before the optimizer (e.g. to finalize the
    backward by hand)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(seed)
    ref = build()
    model = copy.deepcopy(ref)
    if ref_dtype is not None:
        ref = ref.to(ref_dtype)
    wrap(model)
    opt = optimizer(model.parameters())
    ref_opt = optimizer(ref.parameters())
    result = ParityResult()
    for step in range(steps):
        batch = make_batch(step, global_batch)
        local = tuple(t.chunk(world)[rank] for t in batch)
        micro = [tuple(t.chunk(micro_batches)[m] for t in local) for m in range(micro_batches)]
        total = torch.zeros(())
        for index, part in enumerate(micro):
            last = index == micro_batches - 1
            if micro_batches > 1:  # defer all communication, or (HSDP) only the replica all-reduce
                getattr(model, f"set_requires_{defer}")(last)
            loss = loss_fn(model, part) / micro_batches
            loss.backward()
            total += loss.detach().float()
        if finish is not None:
            finish(model)
        norm = None
        if clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        dist.all_reduce(total)
        result.losses.append(total.item() / world)

        ref_loss = loss_fn(ref, batch)
        ref_loss.backward()
        if clip is not None:
            ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
            norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
            torch.testing.assert_close(norm.float(), ref_norm.float(), rtol=rtol * 10, atol=atol)
        ref_opt.step()
        ref_opt.zero_grad()
        result.ref_losses.append(ref_loss.item())
    torch.testing.assert_close(
        torch.tensor(result.losses), torch.tensor(result.ref_losses), rtol=rtol, atol=atol,
        msg=lambda m: f"losses differ: sharded {result.losses} vs reference {result.ref_losses}\n{m}",
    )
    for (name, param), (_, ref_param) in zip(model.named_parameters(), ref.named_parameters()):
        full = param.full_tensor() if hasattr(param, "full_tensor") else param
        diff = (full.float() - ref_param.float()).abs().max().item() if full.numel() else 0.0
        result.max_param_diff = max(result.max_param_diff, diff)
        assert full.shape == ref_param.shape, f"{name}: shape {tuple(full.shape)} vs {tuple(ref_param.shape)}"
        assert diff <= param_atol, f"{name}: final parameters differ by {diff} (> {param_atol})"
    return result
