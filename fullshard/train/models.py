"""The models the main job trains: the project's GPT, or a Hugging Face causal LM from a config.

Every model here offers the same small surface: ``forward(tokens) -> logits``,
``loss(tokens, targets)``, ``layers`` (the units ``fully_shard`` wraps) and
``seq_len``. Hugging Face models are built from a config with random weights
(nothing is downloaded); ``transformers`` is only imported when asked for.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from fullshard.models.gpt import GPT, MODEL_SIZES
from fullshard.train.config import unit_counts

# Small defaults for a config named by model type only ("llama", "qwen2", ...):
# the architecture of that family at a size that trains on a laptop.
SMALL_HF_DEFAULTS = dict(
    vocab_size=256, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
)


class HFCausalLM(nn.Module):
    """A Hugging Face causal LM behind the main job's model surface."""

    def __init__(self, hf_model: nn.Module) -> None:
        super().__init__()
        self.hf = hf_model
        config = hf_model.config
        self.seq_len = min(128, getattr(config, "max_position_embeddings", 128) or 128)
        # Not registered as a submodule (it already is, inside self.hf): no duplicate state-dict keys.
        object.__setattr__(self, "layers", _decoder_layers(hf_model))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.hf(input_ids=tokens, use_cache=False).logits

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self(tokens)
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder blocks: the ModuleList with num_hidden_layers entries (model.layers, transformer.h, ...)."""
    count = getattr(model.config, "num_hidden_layers", None)
    for _, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0 and (count is None or len(module) == count):
            return module
    raise ValueError(f"cannot find the decoder layers of {type(model).__name__}")


def hf_config(spec: str):
    """A config from a model-type name (small defaults), a config.json path, or inline JSON."""
    from transformers import AutoConfig

    path = Path(spec)
    if spec.lstrip().startswith("{"):
        values = json.loads(spec)
    elif path.is_file():
        values = json.loads(path.read_text())
    else:
        return AutoConfig.for_model(spec, **SMALL_HF_DEFAULTS)
    model_type = values.pop("model_type", None)
    if model_type is None:
        raise ValueError(f"--hf-config {spec}: the config has no 'model_type'")
    return AutoConfig.for_model(model_type, **values)


@dataclass(frozen=True)
class ModelSpec:
    """What the main job trains: a GPT size, or a Hugging Face config."""

    model: str = "small"
    hf_config: Optional[str] = None

    def build(self, seed: int) -> nn.Module:
        torch.manual_seed(seed)  # the same full initial weights at every world size
        if self.hf_config is None:
            if MODEL_SIZES[self.model].n_experts:
                from fullshard.models.moe import MoEGPT

                return MoEGPT(MODEL_SIZES[self.model])
            return GPT(MODEL_SIZES[self.model])
        from transformers import AutoModelForCausalLM

        config = hf_config(self.hf_config)
        if getattr(config, "vocab_size", 0) < 256:
            raise ValueError(f"--hf-config: vocab_size {config.vocab_size} < 256 cannot hold byte tokens")
        return HFCausalLM(AutoModelForCausalLM.from_config(config))

    def seq_len(self, model: nn.Module) -> int:
        return model.seq_len if isinstance(model, HFCausalLM) else model.cfg.seq_len


def count_units(model: nn.Module, ep: int = 1) -> dict:
    """Parameters in all, outside the layers (the root unit), and in the largest unit (a layer, or the root);
    for an MoE also per role (``roles``: what ``plan.meshes.MeshShare`` takes, experts split over ``ep``) and
    what its token exchange moves (``exchange``)."""
    counts: dict = unit_counts(sum(p.numel() for p in model.parameters()),
                               [sum(p.numel() for p in layer.parameters()) for layer in model.layers])
    experts = expert_params(model)
    if experts:
        layers = [[p for p in layer.parameters() if id(p) in experts] for layer in model.layers]
        per_layer = [sum(p.numel() for p in params) for params in layers]
        dense = [sum(p.numel() for p in layer.parameters()) - n for layer, n in zip(model.layers, per_layer)]
        counts["roles"] = {"dense": {"units": dense, "root": counts["root_params"], "split": 1},
                           "experts": {"units": per_layer, "root": 0, "split": ep}}
        cfg = model.cfg
        counts["exchange"] = {"layers": cfg.n_layers, "top_k": cfg.top_k, "width": cfg.d_model,
                              "n_experts": cfg.n_experts, "seq_len": cfg.seq_len}
    return counts


def expert_params(model: nn.Module) -> set[int]:
    """The ids of an MoE's routed experts' parameters (``models/moe.py``); empty for any other model."""
    from fullshard.models.moe import MoEGPT

    if not isinstance(model, MoEGPT):
        return set()
    return {id(p) for block in model.layers for p in block.moe.experts.parameters()}
