"""The GPT's sizes, framework-free: the torch module (``gpt.py``) and the MindSpore Cell (``gpt_mindspore.py``)
are built from the same ``GPTConfig``."""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    seq_len: int = 128
    d_model: int = 192
    n_layers: int = 4
    n_heads: int = 6
    mlp_ratio: int = 4
    tie_embeddings: bool = True
    n_experts: int = 0  # > 0: every block's MLP is a mixture of this many experts (moe.py, moe_mindspore.py)
    top_k: int = 2  # experts per token


MODEL_SIZES = {
    "tiny": GPTConfig(seq_len=64, d_model=64, n_layers=2, n_heads=4),
    "small": GPTConfig(),
    "medium": GPTConfig(seq_len=128, d_model=384, n_layers=6, n_heads=6),
    "moe": GPTConfig(seq_len=64, d_model=64, n_layers=2, n_heads=4, mlp_ratio=2, n_experts=4, top_k=2),
}


def init_std(name: str, n_layers: int) -> float:
    """The normal init's std of a matrix parameter (GPT-2's: residual projections scaled down by depth)."""
    return 0.02 / math.sqrt(2 * n_layers) if name.endswith(("proj.weight", "mlp.2.weight")) else 0.02
