"""What the torch benchmark compares: its configurations, each library's contender, and the trainer every
contender runs (the same seeded GPT, AdamW and batches for all)."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from fullshard.bench.meters import CollectiveMeter
from fullshard.models.gpt import GPT, GPTConfig
from fullshard.plan.group import Strategy

# Steps before the measured memory step: lazy initialization and optimizer
# state; DDP also rebuilds its gradient buckets at the start of its second.
WARMUP_STEPS = {"fullshard": 1, "fsdp2": 1, "ddp": 2}
TIMED_BATCHES = max(WARMUP_STEPS.values()) + 1  # batch index of the first timed round


@dataclass(frozen=True)
class Contender:
    label: str  # unique within a configuration
    library: str  # "fullshard" | "fsdp2" | "ddp"
    options: tuple[tuple[str, object], ...]  # extra fully_shard kwargs
    theory: Strategy  # whose traffic formula applies

    @property
    def setup(self) -> str:
        if self.library == "ddp":
            return "DistributedDataParallel"
        module = "fullshard" if self.library == "fullshard" else "torch.distributed.fsdp"
        args = ", ".join(f"{k}={v!r}" for k, v in self.options)
        return f"{module}.fully_shard({args})"


@dataclass(frozen=True)
class Configuration:
    name: str
    precision: str  # "fp32" | "bf16"
    contenders: tuple[Contender, ...]


def configurations() -> list[Configuration]:
    zero3, zero2 = Strategy.OPTIM_GRADS_PARAMS, Strategy.OPTIM_GRADS
    ddp = Contender("ddp", "ddp", (), Strategy.NO_SHARD)
    sharding = {
        "zero3": (
            Contender("fullshard", "fullshard", (), zero3),
            # FSDP2's default: reshard after forward, except the root (gathered again at once).
            Contender("fsdp2", "fsdp2", (), zero3),
            ddp,
        ),
        # fullshard reaches ZeRO-2 two ways: FSDP2's flag (gather once, reshard
        # after backward) or its own strategy (keep the unsharded parameters
        # between steps); both move the same bytes.
        "zero2": (
            Contender("fullshard", "fullshard", (("reshard_after_forward", False),), zero2),
            Contender("fullshard:optim_grads", "fullshard", (("strategy", "optim_grads"),), zero2),
            Contender("fsdp2", "fsdp2", (("reshard_after_forward", False),), zero2),
            ddp,
        ),
    }
    return [
        Configuration(f"{name}-{precision}", precision, contenders)
        for name, contenders in sharding.items()
        for precision in ("fp32", "bf16")
    ]


@dataclass
class Run:
    """What every contender of a rank shares."""

    model: GPTConfig
    device: torch.device
    mesh: object
    rank: int
    world: int
    batch_size: int
    seed: int
    meter: CollectiveMeter


class Trainer:
    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, autocast: Optional[torch.dtype], device):
        self.model = model
        self.optimizer = optimizer
        self.autocast = autocast
        self.device = device

    def step(self, batch: tuple[torch.Tensor, torch.Tensor], probe: Optional[Callable[[], None]] = None) -> torch.Tensor:
        """Forward, backward, optimizer step; ``probe`` runs while the gradients still exist."""
        tokens, targets = batch
        autocast = torch.autocast(self.device.type, dtype=self.autocast) if self.autocast else contextlib.nullcontext()
        with autocast:
            logits = self.model(tokens)
        # The loss outside the model: DDP only syncs what goes through its forward.
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        loss.backward()
        self.optimizer.step()
        if probe is not None:
            probe()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()


def build_trainer(contender: Contender, config: Configuration, run: Run) -> Trainer:
    torch.manual_seed(run.seed)  # the same initial weights for every library
    model = GPT(run.model).to(run.device)
    bf16 = config.precision == "bf16"
    autocast = None
    if contender.library == "ddp":
        model = _ddp(model, run)
        # DDP keeps fp32 parameters; bf16 compute comes from autocast, and its
        # gradients (fp32, like the parameters) are all-reduced in fp32: the
        # closest match to bf16 compute + fp32 reduction.
        autocast = torch.bfloat16 if bf16 else None
    else:
        if contender.library == "fullshard":
            from fullshard import MixedPrecisionPolicy, fully_shard
        else:
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
        options = dict(contender.options)
        for block in model.layers:
            fully_shard(block, mesh=run.mesh, mp_policy=policy, **options)
        fully_shard(model, mesh=run.mesh, mp_policy=policy, **options)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    return Trainer(model, optimizer, autocast, run.device)


def _ddp(model: nn.Module, run: Run) -> nn.Module:
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel

    # Every rank built the same seeded weights, so the start-up broadcast is
    # skipped: gloo may free its buffer on a thread the CPU memory replay
    # does not see (CpuAllocations).
    ddp = DistributedDataParallel(
        model, device_ids=[run.device.index] if run.device.type == "cuda" else None, init_sync=False
    )
    # DDP's built-in all-reduce is issued from C++, invisible to the meter; torch's
    # Python hook does the same (divide by the world size, all-reduce the bucket)
    # through torch.distributed.all_reduce.
    ddp.register_comm_hook(None, allreduce_hook)
    return ddp


def make_batch(run: Run, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's batch of a step: the same for every library."""
    generator = torch.Generator().manual_seed(run.seed * 1_000_003 + step * run.world + run.rank)
    tokens = torch.randint(0, run.model.vocab_size, (run.batch_size, run.model.seq_len + 1), generator=generator)
    tokens = tokens.to(run.device)
    return tokens[:, :-1], tokens[:, 1:]
