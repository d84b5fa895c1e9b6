"""What the main job's runs share whatever the framework: the configuration, a rank's result, the
learning-rate schedule and the unit counts the formulas take."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

FRAMEWORKS = ("torch", "mindspore")
EVAL_BATCHES = 4


@dataclass
class TrainConfig:
    model: str = "small"
    hf_config: Optional[str] = None
    strategy: str = "optim_grads_params"
    mixed_precision: str = "fp32"
    grad_accum: int = 1
    steps: int = 300
    batch_size: int = 16
    lr: float = 3e-3
    seed: int = 0
    data: Optional[list[str]] = None
    checkpoint_dir: Optional[str] = None
    checkpoint_every: int = 0
    resume: bool = False
    out_dir: str = "runs/latest"
    device: str = "cpu"
    timeout_s: int = 600
    framework: str = "torch"
    mesh: str = "auto"  # auto | fsdp | hsdp (fullshard.train.nodes.choose_mesh)
    nodes: dict = field(default_factory=dict)  # fullshard.train.nodes.Nodes as a dict; empty: one node


@dataclass
class RankResult:
    rank: int
    world: int
    losses: dict[int, float] = field(default_factory=dict)  # step -> global mean loss
    val_loss: float = float("nan")
    tokens_per_s: float = 0.0
    peak_rss_bytes: int = 0
    param_bytes: int = 0
    grad_bytes: int = 0
    optim_bytes: int = 0
    start_step: int = 0
    units: dict[str, int] = field(default_factory=dict)  # parameter counts (see unit_counts)
    traffic: dict[str, int] = field(default_factory=dict)  # collective bytes of the last step
    # The runtime's own figures, where it gives them (MindSpore: memory_report's theory, with the CPU emulation)
    theory: Optional[dict] = None
    # Where the rank ran and the mesh its parameters were really sharded on
    node: int = 0
    host: str = ""
    launcher_pid: int = 0  # the agent (torchrun, msrun, fullshard train) that started this process
    mesh_shape: list[int] = field(default_factory=list)
    placements: str = ""


def learning_rate(cfg: TrainConfig, step: int) -> float:
    """Linear warm-up then cosine decay to 10%: a pure function of the step, so resuming needs no state."""
    warmup = max(1, cfg.steps // 20)
    progress = min(1.0, max(0.0, (step - warmup) / max(1, cfg.steps - warmup)))
    scale = (step + 1) / warmup if step < warmup else 0.1 + 0.45 * (1 + math.cos(math.pi * progress))
    return cfg.lr * scale


def unit_counts(total: int, per_layer: list[int]) -> dict[str, int]:
    """Parameters in all, outside the layers (the root unit), and in the largest unit (a layer, or the root)."""
    root = total - sum(per_layer)
    return {"num_params": total, "largest_unit": max(per_layer + [root]), "root_params": root}


def last_checkpoint_hint(checkpoint_dir: Optional[str]) -> str:
    """"; the last complete checkpoint is step N: continue with --resume", or "" when there is none."""
    from fullshard.core.atomic import latest_step

    step = latest_step(Path(checkpoint_dir)) if checkpoint_dir else None
    return f"; the last complete checkpoint is step {step}: continue with --resume" if step else ""
