"""What the main job's runs share whatever the framework: the configuration, a rank's result, the
learning-rate schedule, the unit counts the formulas take, and the record of what a checkpoint
directory's runs trained."""
from __future__ import annotations

import json
import math
import os
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
    ep: int = 1  # --model moe: expert parallelism over this many ranks (fullshard.models.moe)


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
    calls: dict[str, int] = field(default_factory=dict)  # and collective calls (where the runtime counts them)
    # The runtime's own figures, where it gives them (MindSpore: memory_report's theory, with the CPU emulation)
    theory: Optional[dict] = None
    # Where the rank ran and the mesh its parameters were really sharded on
    node: int = 0
    host: str = ""
    launcher_pid: int = 0  # the agent (torchrun, msrun, fullshard train) that started this process
    mesh_shape: list[int] = field(default_factory=list)
    placements: str = ""
    # An MoE wrapped with its experts as units of their own (MindSpore): how many, and the units in all
    experts: Optional[dict] = None
    # Per mesh the parameters shard over (a runtime that records them): its roles ("dense", "experts"), shard
    # ranks and replicas, the bytes held (param/grad/optim_bytes) and the last step's traffic on it
    meshes: list[dict] = field(default_factory=list)
    token_bytes: int = 0  # expert parallelism's all-to-all payload in the last step (plan.meshes)


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
    from fullshard.checkpoint import latest_step

    step = latest_step(Path(checkpoint_dir)) if checkpoint_dir else None
    return f"; the last complete checkpoint is step {step}: continue with --resume" if step else ""


# ---------------------------------------------------------------------- what a checkpoint directory holds
RUN_RECORD = "fullshard.train.json"
# The options that decide the parameters' names and shapes: a checkpoint resumes only into the same ones
# (the strategy, the mesh, the number of ranks and the precision may change: loading reshards).
MODEL_OPTIONS = ("framework", "model", "hf_config")
_MAX_RECORD_BYTES = 1 << 16


def _model_options(cfg: TrainConfig) -> dict:
    options = {name: getattr(cfg, name) for name in MODEL_OPTIONS}
    if options["hf_config"] and Path(options["hf_config"]).exists():  # a file: the same one by any path
        options["hf_config"] = str(Path(options["hf_config"]).resolve())
    return options


def write_run_record(cfg: TrainConfig) -> None:
    """Record, beside the checkpoints this run has just saved, the options that shaped their model (rank 0,
    after each save; replaced atomically). A run that fails before saving leaves the record as it was."""
    import tempfile

    root = Path(cfg.checkpoint_dir)
    handle, scratch = tempfile.mkstemp(prefix=f".{RUN_RECORD}.", dir=root)
    with os.fdopen(handle, "w") as out:
        json.dump(_model_options(cfg), out, sort_keys=True)
    os.replace(scratch, root / RUN_RECORD)


def run_record_mismatch(cfg: TrainConfig) -> Optional[str]:
    """Why ``--resume`` cannot continue the checkpoints under ``cfg.checkpoint_dir`` with ``cfg``'s model, or
    None (also when there is no record: the checkpoint's own check still runs, in the workers). The record
    is read as untrusted input: bounded, JSON, a mapping, or it is refused."""
    path = Path(cfg.checkpoint_dir) / RUN_RECORD
    if not path.is_file():
        return None
    try:
        if path.stat().st_size > _MAX_RECORD_BYTES:
            raise ValueError(f"larger than {_MAX_RECORD_BYTES} bytes")
        recorded = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(recorded, dict):
            raise ValueError("not a JSON object")
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as error:
        return f"{path} is not a fullshard run record ({error}); remove it to resume without this check"
    asked = _model_options(cfg)
    differ = [name for name in MODEL_OPTIONS if recorded.get(name) != asked[name]]
    if not differ:
        return None

    def options(values: dict) -> str:
        return ", ".join(f"--{name.replace('_', '-')} {values.get(name)}" for name in differ)

    return (f"the checkpoints under {cfg.checkpoint_dir} hold a model trained with {options(recorded)} "
            f"({path}); this run builds one with {options(asked)}: pass the former to continue that run, or use "
            f"another --checkpoint-dir")
