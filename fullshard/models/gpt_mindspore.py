"""The project's small GPT as a MindSpore Cell: the same architecture and parameter names as ``gpt.py``.

Byte-level, pre-norm blocks, causal softmax attention written out (MindSpore
2.10 has no fused attention on CPU), and a head tied to the token embedding:
the root multiplies by ``wte.embedding_table`` itself, so the tied weight is
one Parameter. Weights are drawn from a numpy generator seeded by the caller,
so every rank, the single-process reference and a resumed run start alike.
"""
from __future__ import annotations

import math

import mindspore as ms
import numpy as np
from mindspore import Tensor, mint, nn, ops

from fullshard.models.config import GPTConfig, init_std

# Added to the scores of future positions: far below any score, and finite in fp16.
_MASKED = -1e4


def layer_norm(width: int) -> nn.LayerNorm:
    """torch's ``nn.LayerNorm`` (epsilon 1e-5; MindSpore's default is 1e-7): the same function as ``gpt.py``'s."""
    return nn.LayerNorm((width,), epsilon=1e-5)


class CausalSelfAttention(nn.Cell):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        if cfg.d_model % cfg.n_heads:
            raise ValueError(f"d_model={cfg.d_model} must be divisible by n_heads={cfg.n_heads}")
        self.n_heads = cfg.n_heads
        self.qkv = nn.Dense(cfg.d_model, 3 * cfg.d_model, has_bias=False)  # no key bias (see gpt.py)
        self.proj = nn.Dense(cfg.d_model, cfg.d_model)
        self.mask = Tensor(np.triu(np.full((cfg.seq_len, cfg.seq_len), _MASKED, np.float32), k=1))

    def construct(self, x: Tensor) -> Tensor:
        batch, seq, width = x.shape
        head = width // self.n_heads
        q, k, v = mint.split(self.qkv(x), width, dim=-1)
        q, k, v = (t.reshape(batch, seq, self.n_heads, head).swapaxes(1, 2) for t in (q, k, v))
        scores = mint.matmul(q, k.swapaxes(-2, -1)) * (1.0 / math.sqrt(head))
        scores = scores + self.mask[:seq, :seq].astype(scores.dtype)
        y = mint.matmul(ops.softmax(scores, axis=-1), v)
        return self.proj(y.swapaxes(1, 2).reshape(batch, seq, width))


class Block(nn.Cell):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = layer_norm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = layer_norm(cfg.d_model)
        hidden = cfg.mlp_ratio * cfg.d_model
        self.mlp = nn.SequentialCell([nn.Dense(cfg.d_model, hidden), nn.GELU(approximate=False),
                                      nn.Dense(hidden, cfg.d_model)])

    def construct(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))

    def inner_units(self) -> list[nn.Cell]:
        """The cells wrapped as units of their own inside this block (the MoE block's experts): none."""
        return []


class GPT(nn.Cell):
    block_class = Block  # the MoE GPT's blocks differ (moe_mindspore.py)

    def __init__(self, cfg: GPTConfig, seed: int = 0) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.layers = nn.CellList([self.block_class(cfg) for _ in range(cfg.n_layers)])
        self.ln_f = layer_norm(cfg.d_model)
        if not cfg.tie_embeddings:
            self.lm_head = nn.Dense(cfg.d_model, cfg.vocab_size, has_bias=False)
        self.positions = Tensor(np.arange(cfg.seq_len, dtype=np.int32))
        self.reset_parameters(seed)

    def reset_parameters(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        for name, param in self.parameters_and_names():
            if name.endswith(("bias", "beta")):
                value = np.zeros(param.shape, np.float32)
            elif param.ndim == 1:
                value = np.ones(param.shape, np.float32)
            else:
                value = rng.normal(0.0, init_std(name, self.cfg.n_layers), param.shape).astype(np.float32)
            param.set_data(Tensor(value, dtype=param.dtype))

    def construct(self, tokens: Tensor) -> Tensor:
        x = self.wte(tokens) + self.wpe(self.positions[: tokens.shape[1]])
        for layer in self.layers:
            x = layer(x)
        x = self.ln_f(x)
        head = self.wte.embedding_table if self.cfg.tie_embeddings else self.lm_head.weight
        return mint.matmul(x, head.swapaxes(0, 1))

    def loss(self, tokens: Tensor, targets: Tensor) -> Tensor:
        logits = self(tokens)
        return ops.cross_entropy(logits.reshape(-1, logits.shape[-1]).astype(ms.float32), targets.reshape(-1))


def count_units(model: GPT) -> dict[str, int]:
    """Parameters in all, outside the layers (the root unit) and in the largest unit (tied weights once); a
    block's inner units (an MoE block's experts) count apart from the rest of it."""
    from fullshard.train.config import unit_counts

    def size(cell: nn.Cell) -> int:
        return sum(p.size for p in cell.get_parameters())

    units = []
    for layer in model.layers:
        inner = [size(cell) for cell in layer.inner_units()]
        units += [*inner, size(layer) - sum(inner)]
    return unit_counts(size(model), units)
