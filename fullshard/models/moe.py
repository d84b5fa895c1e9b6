"""A small mixture-of-experts GPT written plainly (``--model moe``), and how the main job makes it expert parallel.

Each block's MLP is an MoE layer: a router picks every token's top-k experts (softmax, renormalised over the
chosen ones), the experts are two grouped weights (``w_in [experts, d, h]``, ``w_out [experts, h, d]``), and a
shared dense expert sees every token. Attention, embeddings and the tied head are ``gpt.py``'s.

Expert parallelism (``expert_parallel``): the ``ep`` ranks of a group split the experts (the grouped weights
become DTensors ``Shard(0)`` on the ``ep`` mesh), and tokens travel to their experts' rank and back with
``all_to_all_single``. ``expert_placement`` then puts those weights on the expert-FSDP mesh through
``shard_placement_fn`` (docs/moe.md).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from fullshard.models.config import GPTConfig
from fullshard.models.gpt import GPT, CausalSelfAttention


def _local(weight: torch.Tensor) -> torch.Tensor:
    """An expert-parallel weight's own experts (forward sees the ``ep`` DTensor)."""
    return weight.to_local() if hasattr(weight, "to_local") else weight


class GroupedExperts(nn.Module):
    def __init__(self, n_experts: int, width: int, hidden: int) -> None:
        super().__init__()
        self.w_in = nn.Parameter(torch.empty(n_experts, width, hidden))
        self.w_out = nn.Parameter(torch.empty(n_experts, hidden, width))

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """``x``: tokens sorted by expert, ``counts[e]`` of them for local expert ``e``."""
        w_in, w_out = _local(self.w_in), _local(self.w_out)
        parts = torch.split(x, counts)
        return torch.cat([F.gelu(part @ w_in[e].to(part.dtype)) @ w_out[e].to(part.dtype)
                          for e, part in enumerate(parts)])


class TokenExchange:
    """One ``ep`` group's token exchange: tokens sorted by expert go to the rank holding it, and come back.

    ``bytes`` counts what the exchange's all-to-alls carried since it was zeroed, each by its buffer of this
    rank's own tokens (what it dispatches and gets back, and in backward their gradients) plus the routing
    counts: ``plan.meshes.token_exchange_bytes`` states it."""

    def __init__(self, group: dist.ProcessGroup, n_experts: int) -> None:
        self.group, self.size = group, dist.get_world_size(group)
        self.per_rank = n_experts // self.size
        self.bytes = 0

    def _count(self, tensor: torch.Tensor) -> None:
        """Count ``tensor``'s all-to-all, and the one its gradient takes back in backward."""
        self.bytes += tensor.numel() * tensor.element_size()
        if tensor.requires_grad:
            tensor.register_hook(lambda grad: self._count(grad))

    def __call__(self, experts: nn.Module, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        from torch.distributed.nn.functional import all_to_all_single  # the autograd-aware one

        received = torch.empty_like(counts)  # [source rank, local expert]: tokens this rank receives
        dist.all_to_all_single(received, counts, group=self.group)
        self._count(counts)
        by_source = received.view(self.size, self.per_rank)
        send = counts.view(self.size, self.per_rank).sum(1).tolist()
        recv = by_source.sum(1).tolist()
        tokens = all_to_all_single(x.new_empty(sum(recv), x.shape[1]), x, recv, send, group=self.group)
        self._count(x)
        # they arrive by source rank, each sorted by local expert: regroup by expert, and back after
        cell = torch.repeat_interleave(torch.arange(by_source.numel(), device=x.device), by_source.flatten())
        order = torch.argsort((cell % self.per_rank) * by_source.numel() + cell, stable=True)
        out = experts(tokens[order], by_source.sum(0).tolist())
        back = torch.empty_like(out).index_copy(0, order, out)
        mine = all_to_all_single(x.new_empty(sum(send), x.shape[1]), back, send, recv, group=self.group)
        self._count(mine)
        return mine


class MoE(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        hidden = cfg.mlp_ratio * cfg.d_model
        self.n_experts, self.top_k = cfg.n_experts, cfg.top_k
        self.router = nn.Linear(cfg.d_model, cfg.n_experts, bias=False)
        self.shared = nn.Sequential(nn.Linear(cfg.d_model, hidden), nn.GELU(), nn.Linear(hidden, cfg.d_model))
        self.experts = GroupedExperts(cfg.n_experts, cfg.d_model, hidden)
        self.exchange: Optional[Callable] = None  # TokenExchange under expert parallelism

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        gates, chosen = torch.softmax(self.router(flat).float(), -1).topk(self.top_k, -1)
        gates = (gates / gates.sum(-1, keepdim=True)).to(flat.dtype)
        order = torch.argsort(chosen.flatten(), stable=True)  # (token, slot) pairs by expert
        token = order // self.top_k
        counts = torch.bincount(chosen.flatten(), minlength=self.n_experts)
        if self.exchange is None:
            out = self.experts(flat[token], counts.tolist())
        else:
            out = self.exchange(self.experts, flat[token], counts)
        routed = torch.zeros_like(flat).index_add(0, token, out * gates.flatten()[order].unsqueeze(-1))
        return (self.shared(flat) + routed).view_as(x)


class MoEBlock(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.moe = MoE(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.moe(self.ln2(x))


class MoEGPT(GPT):
    """``gpt.py``'s GPT with MoE blocks (``cfg.n_experts`` experts, top ``cfg.top_k``)."""

    block_class = MoEBlock


# ---------------------------------------------------------------------------------------------- expert parallel
@dataclass(frozen=True)
class ExpertMesh:
    """FSDP2's ``FSDPMeshInfo`` fields that ``fully_shard`` reads (torch's own class is private: not imported)."""

    mesh: Any
    shard_mesh_dim: int = 0
    replicate_mesh_dim: Optional[int] = None


@dataclass(frozen=True)
class Placed:
    """FSDP2's ``ShardPlacementResult``: a placement on a mesh of its own."""

    placement: Any
    mesh_info: ExpertMesh


def expert_parallel(model: MoEGPT, ep_mesh: Any) -> MoEGPT:
    """Split every block's experts across ``ep_mesh`` (grouped weights ``Shard(0)`` there) and exchange tokens."""
    from torch.distributed.tensor import Shard, distribute_tensor

    size = ep_mesh.size()
    if model.cfg.n_experts % size:
        raise ValueError(f"expert parallelism over {size} ranks needs a multiple of {size} experts, "
                         f"not {model.cfg.n_experts}; change --ep or the model's n_experts")
    for block in model.layers:
        experts = block.moe.experts
        for name in ("w_in", "w_out"):
            weight = getattr(experts, name).detach()
            setattr(experts, name, nn.Parameter(distribute_tensor(weight, ep_mesh, [Shard(0)])))
        block.moe.exchange = TokenExchange(ep_mesh.get_group(), model.cfg.n_experts)
    return model


def expert_placement(model: MoEGPT, expert_mesh: Any) -> Callable[[nn.Parameter], Any]:
    """A ``shard_placement_fn`` putting the experts on ``expert_mesh`` (dim 0) and the rest on the call's mesh."""
    from torch.distributed.tensor import Shard

    info = ExpertMesh(expert_mesh)  # one object for every expert: fully_shard makes one group of them
    experts = {id(p) for block in model.layers for p in block.moe.experts.parameters()}
    return lambda param: Placed(Shard(0), info) if id(param) in experts else None
