"""The small mixture-of-experts GPT (``--model moe``) as a MindSpore Cell: ``moe.py``'s model, same sizes and names.

Each block's MLP is an MoE layer: a router picks every token's top-k experts (softmax, renormalised over the
chosen ones), the experts are two grouped weights (``w_in [experts, d, h]``, ``w_out [experts, h, d]``), and a
shared dense expert sees every token. Attention, embeddings, the tied head and the initialisation are
``gpt_mindspore.py``'s.

No expert parallelism: MindSpore 2.10's CPU backend has no all-to-all, so every rank routes its own tokens to
its own copy of every expert. The main job makes the experts a unit of their own (``inner_units``), as
mindformers does, sharded over the same mesh as the rest (docs/moe.md).

Which tokens go to which expert is an integer decision with no gradient: it is made on the host (MindSpore 2.10
has no CPU kernel for a stable argsort or bincount); the gates, the gathers and the sums stay in the graph.
"""
from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, mint, nn, ops

from fullshard.models.config import GPTConfig
from fullshard.models.gpt_mindspore import GPT, CausalSelfAttention, layer_norm


class GroupedExperts(nn.Cell):
    def __init__(self, n_experts: int, width: int, hidden: int) -> None:
        super().__init__()
        # filled by GPT.reset_parameters (normal, as every matrix)
        self.w_in = Parameter(Tensor(np.zeros((n_experts, width, hidden), np.float32)), name="w_in")
        self.w_out = Parameter(Tensor(np.zeros((n_experts, hidden, width), np.float32)), name="w_out")

    def construct(self, x: Tensor, counts: list[int]) -> Tensor:
        """``x``: tokens sorted by expert, ``counts[e]`` of them for expert ``e`` (one with none is skipped)."""
        parts = mint.split(x, counts)
        return mint.cat([mint.matmul(ops.gelu(mint.matmul(part, self.w_in[e]), approximate="none"), self.w_out[e])
                         for e, part in enumerate(parts) if counts[e]])


class MoE(nn.Cell):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        hidden = cfg.mlp_ratio * cfg.d_model
        self.n_experts, self.top_k = cfg.n_experts, cfg.top_k
        self.router = nn.Dense(cfg.d_model, cfg.n_experts, has_bias=False)
        self.shared = nn.SequentialCell([nn.Dense(cfg.d_model, hidden), nn.GELU(approximate=False),
                                         nn.Dense(hidden, cfg.d_model)])
        self.experts = GroupedExperts(cfg.n_experts, cfg.d_model, hidden)

    def construct(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, x.shape[-1])
        gates, chosen = ops.topk(ops.softmax(self.router(flat).astype(ms.float32), -1), self.top_k)
        gates = (gates / gates.sum(-1, keepdims=True)).astype(flat.dtype)
        picks = chosen.asnumpy().reshape(-1)
        order = np.argsort(picks, kind="stable")  # (token, slot) pairs by expert
        token = Tensor((order // self.top_k).astype(np.int32))
        counts = np.bincount(picks, minlength=self.n_experts).tolist()
        out = self.experts(ops.gather(flat, token, 0), counts)
        weights = ops.gather(gates.reshape(-1), Tensor(order.astype(np.int32)), 0).reshape(-1, 1)
        routed = ops.unsorted_segment_sum(out * weights, token, flat.shape[0])
        return (self.shared(flat) + routed).reshape(x.shape)


class MoEBlock(nn.Cell):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = layer_norm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = layer_norm(cfg.d_model)
        self.moe = MoE(cfg)

    def construct(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.moe(self.ln2(x))

    def inner_units(self) -> list[nn.Cell]:
        """The cells wrapped as units of their own inside this block: the experts."""
        return [self.moe.experts]


class MoEGPT(GPT):
    """``gpt_mindspore.py``'s GPT with MoE blocks (``cfg.n_experts`` experts, top ``cfg.top_k``)."""

    block_class = MoEBlock
