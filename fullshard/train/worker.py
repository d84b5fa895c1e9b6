"""The training loop of ``fullshard train``: one process per rank, and the single-process reference.

Everything a step consumes is a function of (seed, step): the global batch,
the initial weights, and (on resume) the checkpointed model and optimizer
state. That is what makes ``--verify`` and ``--resume`` exact.
"""
from __future__ import annotations

import datetime
import json
import os
import socket
import time
from dataclasses import asdict

import torch
import torch.distributed as dist
import torch.nn as nn

from fullshard.torch.clip import clip_grad_norm_  # across meshes (--ep); torch's own within one
from fullshard.train.procs import peak_rss_bytes
from fullshard.plan.exchange import DEFAULT_BACKENDS
from fullshard.core.buffers import KINDS, reset_traffic, traffic, traffic_by_mesh
from fullshard.train import rollcall
from fullshard.train.config import EVAL_BATCHES, RankResult, TrainConfig, learning_rate, write_run_record
from fullshard.train.data import ByteCorpus
from fullshard.train.models import ModelSpec, count_units, expert_params
from fullshard.train.nodes import Nodes, choose_mesh, nodes_of
from fullshard.train.progress import Progress


def model_spec(cfg: TrainConfig) -> ModelSpec:
    return ModelSpec(cfg.model, cfg.hf_config)


def build_model(cfg: TrainConfig) -> nn.Module:
    return model_spec(cfg).build(cfg.seed)


def make_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.1)


def build_mesh(cfg: TrainConfig, nodes: Nodes):
    """The mesh ``--mesh`` chose; None for FSDP (fully_shard's default: 1-D over every rank)."""
    choice = choose_mesh(cfg.mesh, nodes, cfg.strategy)
    if choice.kind == "fsdp":
        return None
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(cfg.device, choice.shape, mesh_dim_names=choice.dim_names)


def shard(model: nn.Module, cfg: TrainConfig, mesh=None) -> nn.Module:
    from fullshard import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy()
    if cfg.mixed_precision == "bf16":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    placement = None
    if expert_params(model) and mesh is None and cfg.strategy != "no_shard":
        mesh, placement = _expert_parallel(model, cfg)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp, strategy=cfg.strategy, shard_placement_fn=placement)
    fully_shard(model, mesh=mesh, mp_policy=mp, strategy=cfg.strategy)
    return model


def _expert_parallel(model: nn.Module, cfg: TrainConfig):
    """An MoE: torchtitan's layout, ``(efsdp, ep)`` with ep innermost; experts split over ``ep`` and sharded over
    ``efsdp``, everything else over every rank. Returns the dense mesh and the ``shard_placement_fn``.

    With ``--ep 1`` nothing is split and no token travels, but the experts still shard over a mesh of their
    own (efsdp: every rank, its own process group), so their memory and traffic are measured apart from the
    dense weights' (the report's rows per mesh)."""
    from torch.distributed.device_mesh import init_device_mesh

    from fullshard.models.moe import expert_parallel, expert_placement

    world = dist.get_world_size()
    dense = init_device_mesh(cfg.device, (world,), mesh_dim_names=("fsdp",))
    if cfg.ep == 1:  # a mesh over every rank reuses the default group: the experts' needs a group of its own
        from torch.distributed.device_mesh import DeviceMesh

        efsdp = DeviceMesh.from_group(dist.new_group(list(range(world))), cfg.device, mesh_dim_names=("efsdp",))
        return dense, expert_placement(model, efsdp)
    sparse = init_device_mesh(cfg.device, (world // cfg.ep, cfg.ep), mesh_dim_names=("efsdp", "ep"))
    expert_parallel(model, sparse["ep"])
    return dense, expert_placement(model, sparse["efsdp"])


def _record_placement(result: RankResult, model: nn.Module, nodes: Nodes) -> None:
    """Where this rank ran, and the mesh and placements its parameters really have (not what was asked)."""
    param = next(model.parameters())
    result.node, result.host, result.launcher_pid = nodes.node_rank, socket.gethostname(), os.getppid()
    result.mesh_shape, result.placements = list(param.device_mesh.shape), str(tuple(param.placements))


def _meshes(model: nn.Module) -> list[dict]:
    """The meshes this rank's parameters shard over (``accounting.mesh_params``), each with the roles of its
    parameters (an MoE's routed experts, or dense): the report's rows per mesh, filled in as the run goes."""
    from fullshard.torch.accounting import mesh_params

    experts = expert_params(model)
    return [{"key": key, "roles": sorted({"experts" if id(p) in experts else "dense" for p in mesh["params"]}),
             "shards": mesh["shards"], "replicas": mesh["replicas"], "params": mesh["params"]}
            for key, mesh in mesh_params(model).items()]


def _record_step(result: RankResult, model: nn.Module, meshes: list[dict], grads: bool) -> None:
    """The step's traffic, in all and per mesh, and the token exchange's; the gradients held (``grads``)."""
    result.traffic = dict(traffic)
    per_mesh = traffic_by_mesh()
    for mesh in meshes:
        mesh["traffic"] = per_mesh.get(mesh["key"], dict.fromkeys(KINDS, 0))
        if grads:
            mesh["grad_bytes"] = _local_bytes(p.grad for p in mesh["params"] if p.grad is not None)
    result.token_bytes = sum(exchange.bytes for exchange in _exchanges(model))
    if grads:
        result.grad_bytes = _local_bytes(p.grad for p in model.parameters() if p.grad is not None)


def _exchanges(model: nn.Module) -> list:
    """An expert-parallel MoE's token exchanges (``models/moe.py``), one per block; none for other models."""
    return [block.moe.exchange for block in model.layers if getattr(getattr(block, "moe", None), "exchange", None)]


def _share_from_rank0(text: str) -> str:
    box = [text]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def set_learning_rate(optimizer: torch.optim.Optimizer, cfg: TrainConfig, step: int) -> None:
    for group in optimizer.param_groups:
        group["lr"] = learning_rate(cfg, step)


def _local_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        total += t.numel() * t.element_size()
    return total


def save_checkpoint(cfg: TrainConfig, model, optimizer, step: int) -> None:
    from fullshard.checkpoint import step_dir
    from fullshard.torch import checkpoint

    checkpoint.save_checkpoint(model, step_dir(cfg.checkpoint_dir, step), optimizer)
    if dist.get_rank() == 0:
        write_run_record(cfg)


def load_checkpoint(cfg: TrainConfig, model, optimizer) -> int:
    """Load the latest checkpoint under ``cfg.checkpoint_dir`` (found as ``export`` finds it); its step."""
    from fullshard.checkpoint import latest_step, step_dir
    from fullshard.torch import checkpoint

    step = latest_step(cfg.checkpoint_dir)
    if step is None:
        raise FileNotFoundError(f"--resume: no complete checkpoint under {cfg.checkpoint_dir}")
    checkpoint.load_checkpoint(model, step_dir(cfg.checkpoint_dir, step), optimizer)
    return step


def run_rank(cfg: TrainConfig) -> list[dict]:
    """Train on this rank (initializing the process group if needed); returns every rank's RankResult."""
    torch.set_num_threads(1)
    if not dist.is_initialized():
        dist.init_process_group(DEFAULT_BACKENDS[cfg.device], timeout=datetime.timedelta(seconds=cfg.timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    roll = rollcall.start_for_job(cfg, rank, world, _share_from_rank0)
    with rollcall.watching(roll):
        return _train(cfg, rank, world, roll)


def _train(cfg: TrainConfig, rank: int, world: int, roll) -> list[dict]:
    if cfg.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    device = torch.device(cfg.device, torch.cuda.current_device()) if cfg.device == "cuda" else torch.device("cpu")
    nodes = nodes_of(cfg, world)
    corpus = ByteCorpus.load(cfg.data)
    model = build_model(cfg)
    seq_len = model_spec(cfg).seq_len(model)
    result = RankResult(rank, world, units=count_units(model, cfg.ep))
    model = shard(model, cfg, build_mesh(cfg, nodes))
    meshes = _meshes(model)
    _record_placement(result, model, nodes)
    optimizer = make_optimizer(model, cfg)
    start = load_checkpoint(cfg, model, optimizer) if cfg.resume else 0
    result.start_step = start
    _train_steps(cfg, model, optimizer, corpus, seq_len, result, device, roll, meshes)
    result.val_loss = evaluate(model, corpus, cfg, seq_len, rank, world, device)
    result.param_bytes = _local_bytes(model.parameters())
    result.optim_bytes = _local_bytes(v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v))
    result.peak_rss_bytes = peak_rss_bytes()
    for mesh in meshes:
        params = mesh.pop("params")
        mesh["param_bytes"] = _local_bytes(params)
        mesh["optim_bytes"] = _local_bytes(v for p in params for v in optimizer.state[p].values() if torch.is_tensor(v))
    result.meshes = meshes
    gathered = [None] * world
    dist.all_gather_object(gathered, asdict(result))
    return gathered


def _train_steps(cfg: TrainConfig, model, optimizer, corpus: ByteCorpus, seq_len: int, result: RankResult, device,
                 roll, meshes: list[dict]) -> None:
    """Steps ``result.start_step`` to ``cfg.steps``: losses, traffic, gradient bytes and speed into ``result``."""
    rank, world, start = result.rank, result.world, result.start_step
    micro = cfg.batch_size // world // cfg.grad_accum
    progress = Progress(cfg.steps, start, enabled=rank == 0)
    tokens_done, timed = 0, 0.0
    for step in range(start, cfg.steps):
        if roll is not None:
            roll.step = step
        began = time.perf_counter()
        reset_traffic()
        for exchange in _exchanges(model):
            exchange.bytes = 0
        set_learning_rate(optimizer, cfg, step)
        tokens, targets = (torch.from_numpy(t).chunk(world)[rank].to(device)
                           for t in corpus.batch("train", cfg.seed, step, cfg.batch_size, seq_len))
        total = torch.zeros((), device=device)
        for index in range(cfg.grad_accum):
            model.set_requires_gradient_sync(index == cfg.grad_accum - 1)
            part = slice(index * micro, (index + 1) * micro)
            loss = model.loss(tokens[part], targets[part]) / cfg.grad_accum
            loss.backward()
            total += loss.detach()
        clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        _record_step(result, model, meshes, grads=step == cfg.steps - 1 or step == start)
        optimizer.zero_grad(set_to_none=True)
        dist.all_reduce(total)
        loss_value = total.item() / world
        result.losses[step] = loss_value
        if step > start:  # the first step pays for warm-up (lazy init, allocator)
            timed += time.perf_counter() - began
            tokens_done += cfg.batch_size * seq_len
        progress.update(step, loss_value, tokens_done / timed if timed else 0.0, peak_rss_bytes())
        if cfg.checkpoint_dir and cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0:
            save_checkpoint(cfg, model, optimizer, step + 1)
    progress.close()
    result.tokens_per_s = tokens_done / timed if timed else 0.0


@torch.no_grad()
def evaluate(model, corpus: ByteCorpus, cfg: TrainConfig, seq_len: int, rank: int, world: int, device) -> float:
    total = torch.zeros((), device=device)
    for index in range(EVAL_BATCHES):
        tokens, targets = (torch.from_numpy(t).chunk(world)[rank].to(device)
                           for t in corpus.batch("val", cfg.seed, index, max(world, cfg.batch_size), seq_len))
        total += model.loss(tokens, targets)
    dist.all_reduce(total)
    return total.item() / world / EVAL_BATCHES


def reference_losses(cfg: TrainConfig) -> dict[int, float]:
    """Single-process training on the same global batches (from step 0): what the sharded run must match."""
    torch.set_num_threads(max(1, torch.get_num_threads()))
    corpus = ByteCorpus.load(cfg.data)
    model = build_model(cfg)
    seq_len = model_spec(cfg).seq_len(model)
    optimizer = make_optimizer(model, cfg)
    losses = {}
    for step in range(cfg.steps):
        tokens, targets = (torch.from_numpy(t) for t in corpus.batch("train", cfg.seed, step, cfg.batch_size, seq_len))
        if cfg.mixed_precision == "bf16":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model.loss(tokens, targets)
        else:
            loss = model.loss(tokens, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        set_learning_rate(optimizer, cfg, step)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses[step] = loss.item()
    return losses


def worker_entry(cfg_json: str) -> list[dict]:
    """Entry point of each process started by the elastic launcher."""
    cfg = TrainConfig(**json.loads(cfg_json))
    try:
        return run_rank(cfg)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
