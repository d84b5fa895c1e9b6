"""``fullshard train --framework mindspore``: one msrun worker per rank, its launcher, and the reference.

The same job as the torch worker (``worker.py``): the same global batches
(``data.py``), learning-rate schedule and unit counts (``config.py``), the
GPT written as a MindSpore Cell (``fullshard/models/gpt_mindspore.py``; ``--model moe``:
``moe_mindspore.py``), ``fullshard.mindspore.fully_shard`` per layer (an MoE block's experts first, a unit
of their own) and at the root,
``nn.AdamWeightDecay`` (betas 0.9/0.95, weight decay 0.1, as torch's AdamW),
clipping to a global norm of 1, and sharded checkpoints
(``fullshard.mindspore.save_checkpoint``). Each worker writes its result as
JSON into the launch's run directory; rank 0 also writes the progress lines
the launcher prints. On several nodes (machines whose run directories
differ) rank 0 collects every rank's result with a collective and writes
them all, so node 0's launcher reports on every rank.
"""
from __future__ import annotations

import json
import os
import socket
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Optional

import numpy as np

from fullshard.checkpoint import latest_step, step_dir
from fullshard.train.procs import peak_rss_bytes
from fullshard.models.config import MODEL_SIZES
from fullshard.train import rollcall
from fullshard.train.config import EVAL_BATCHES, RankResult, TrainConfig, learning_rate, write_run_record
from fullshard.train.data import ByteCorpus
from fullshard.train.nodes import Nodes, choose_mesh, nodes_of
from fullshard.train.progress import Progress

CONFIG_FILE, PROGRESS_FILE, RESULTS_FILE = "config.json", "progress.log", "results.json"
os.environ.setdefault("GLOG_v", "3")  # MindSpore's own log: errors only (read when MindSpore is imported)


def _setup() -> None:
    import mindspore as ms

    from fullshard.mindspore.cpu import configure_cpu_worker

    ms.set_context(mode=ms.PYNATIVE_MODE)
    ms.set_device("CPU")
    configure_cpu_worker()


def build_model(cfg: TrainConfig):
    from fullshard.models.gpt_mindspore import GPT
    from fullshard.models.moe_mindspore import MoEGPT

    size = MODEL_SIZES[cfg.model]
    return (MoEGPT if size.n_experts else GPT)(size, seed=cfg.seed)


def make_optimizer(params, cfg: TrainConfig):
    from mindspore import nn

    return nn.AdamWeightDecay(params, learning_rate=cfg.lr, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


def set_learning_rate(optimizer, cfg: TrainConfig, step: int) -> None:
    import mindspore as ms
    from mindspore import Tensor, ops

    # assign, not set_data: the optimizer's compiled graph holds the Parameter's storage
    ops.assign(optimizer.learning_rate, Tensor(learning_rate(cfg, step), ms.float32))


def build_mesh(cfg: TrainConfig, nodes: Nodes):
    """The mesh ``--mesh`` chose; None for FSDP (fully_shard's default: 1-D over every rank)."""
    from fullshard.mindspore import init_device_mesh

    choice = choose_mesh(cfg.mesh, nodes, cfg.strategy)
    return init_device_mesh("cpu", choice.shape, mesh_dim_names=choice.dim_names) if choice.kind == "hsdp" else None


def shard(model, cfg: TrainConfig, mesh=None):
    import mindspore as ms

    from fullshard.mindspore import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=ms.float16, reduce_dtype=ms.float32) if cfg.mixed_precision == "fp16" else None
    for layer in model.layers:
        # an MoE block's experts: a unit of their own (mindformers' wrapping), on the same mesh: no expert
        # parallelism on MindSpore's CPU backend, which has no all-to-all (docs/moe.md)
        for inner in layer.inner_units():
            fully_shard(inner, mesh=mesh, mp_policy=mp, strategy=cfg.strategy)
        fully_shard(layer, mesh=mesh, mp_policy=mp, strategy=cfg.strategy)
    return fully_shard(model, mesh=mesh, mp_policy=mp, strategy=cfg.strategy)


def _record_placement(result: RankResult, model, nodes: Nodes) -> None:
    """Where this rank ran, and the groups its parameters are really sharded and replicated over."""
    from fullshard.mindspore.param import sharded_param_of

    group = sharded_param_of(model.trainable_params()[0]).group
    shard, replica = group.comm, group.replica
    result.node, result.host, result.launcher_pid = nodes.node_rank, socket.gethostname(), os.getppid()
    result.mesh_shape = [replica.size, shard.size] if replica is not None else [shard.size]
    result.placements = f"shards over {shard.size} ranks" + (
        f", replicated over {replica.size} (groups {replica.group}, {shard.group})" if replica is not None else "")
    if model.cfg.n_experts:
        _record_experts(result, model)


def _record_experts(result: RankResult, model) -> None:
    """The MoE's experts as they were really wrapped: units of their own, and the units of the whole model."""
    from fullshard.core.unit import distinct_units
    from fullshard.mindspore import FSDPModule

    expert_units = [cell for layer in model.layers for cell in layer.inner_units() if isinstance(cell, FSDPModule)]
    result.experts = {"experts": model.cfg.n_experts, "top_k": model.cfg.top_k, "units": len(expert_units),
                      "units_in_all": len(distinct_units(cell for _, cell in model.cells_and_names()))}


def _ids(array: np.ndarray):
    from mindspore import Tensor

    return Tensor(array.astype(np.int32))


def _rows(array: np.ndarray, rank: int, world: int) -> np.ndarray:
    per = array.shape[0] // world
    return array[rank * per:(rank + 1) * per]


def _broadcast_text(text: str, size: int = 256) -> str:
    """Rank 0's ``text`` on every rank (the roll call's address)."""
    from mindspore import Tensor, ops

    data = np.zeros(size, np.int32)
    encoded = text.encode()
    data[:len(encoded)] = np.frombuffer(encoded, np.uint8)
    (out,) = ops.Broadcast(0)((Tensor(data),))
    values = out.asnumpy()
    return bytes(values[values != 0].astype(np.uint8)).decode()


def _gather_results(result: dict) -> list[dict]:
    """Every rank's result on every rank: an all-gather of JSON bytes (int32 words, which CPU AllGather takes)."""
    from mindspore import Tensor, ops

    encoded = json.dumps(result).encode()
    sizes = ops.AllGather()(Tensor(np.array([len(encoded)], np.int32))).asnumpy()
    words = -(-int(sizes.max()) // 4)
    padded = np.zeros(words * 4, np.uint8)
    padded[:len(encoded)] = np.frombuffer(encoded, np.uint8)
    gathered = ops.AllGather()(Tensor(padded.view(np.int32))).asnumpy().view(np.uint8).reshape(len(sizes), -1)
    return [json.loads(bytes(row[:size])) for row, size in zip(gathered, sizes)]


def _sum_over_ranks(value: float) -> float:
    from mindspore import Tensor, ops

    return float(ops.AllReduce()(Tensor(np.array([value], np.float32))).asnumpy()[0])


def resume(cfg: TrainConfig, model, optimizer) -> int:
    """Load the latest checkpoint under ``cfg.checkpoint_dir`` (found as ``export`` finds it); its step."""
    from fullshard.mindspore import load_checkpoint

    start = latest_step(cfg.checkpoint_dir)
    if start is None:
        raise FileNotFoundError(f"--resume: no complete checkpoint under {cfg.checkpoint_dir}")
    load_checkpoint(model, step_dir(cfg.checkpoint_dir, start), optimizer)
    return start


def run_rank(cfg: TrainConfig, run_dir: Path) -> dict:
    """Train on this msrun worker; writes ``result_<rank>.json`` into ``run_dir`` (rank 0: every rank's too)."""
    from mindspore.communication import get_group_size, get_rank, init

    from fullshard.train.msrun import register_worker

    _setup()
    init()
    rank, world = get_rank(), get_group_size()
    register_worker(rank)
    roll = rollcall.start_for_job(cfg, rank, world, _broadcast_text)
    with rollcall.watching(roll):
        result = _train(cfg, run_dir, rank, world, roll)
        everyone = _gather_results(result)
    (run_dir / f"result_{rank}.json").write_text(json.dumps(result))
    if rank == 0:
        (run_dir / RESULTS_FILE).write_text(json.dumps(everyone))
    return result


def _train(cfg: TrainConfig, run_dir: Path, rank: int, world: int, roll) -> dict:
    from fullshard.mindspore import memory_report
    from fullshard.models.gpt_mindspore import count_units

    corpus = ByteCorpus.load(cfg.data)
    model = build_model(cfg)
    seq_len = model.cfg.seq_len
    result = RankResult(rank, world, units=count_units(model))
    nodes = nodes_of(cfg, world)
    shard(model, cfg, build_mesh(cfg, nodes))
    _record_placement(result, model, nodes)
    optimizer = make_optimizer(model.trainable_params(), cfg)
    start = resume(cfg, model, optimizer) if cfg.resume else 0
    result.start_step = start
    stream = open(run_dir / PROGRESS_FILE, "a") if rank == 0 else None
    progress = Progress(cfg.steps, start, enabled=rank == 0, stream=stream)
    try:
        _train_steps(cfg, model, optimizer, corpus, seq_len, result, progress, roll)
    finally:
        if stream is not None:
            stream.close()
    report = memory_report(model, optimizer)
    result.val_loss = evaluate(model, corpus, cfg, seq_len, rank, world)
    result.param_bytes = report["measured"]["params"]
    result.optim_bytes = report["measured"]["optim"]
    result.theory = report.get("theory")
    result.peak_rss_bytes = peak_rss_bytes()
    return asdict(result)


def _train_steps(cfg: TrainConfig, model, optimizer, corpus: ByteCorpus, seq_len: int, result: RankResult,
                 progress: Progress, roll) -> None:
    """Steps ``result.start_step`` to ``cfg.steps``: losses, traffic, gradient bytes and speed into ``result``."""
    import mindspore as ms

    from fullshard.core.buffers import collective_calls, reset_traffic, traffic_bytes
    from fullshard.mindspore import clip_grad_norm, save_checkpoint

    rank, world, start = result.rank, result.world, result.start_step
    grad_fn = ms.value_and_grad(lambda x, y: model.loss(x, y) / cfg.grad_accum, None, optimizer.parameters)
    micro = cfg.batch_size // world // cfg.grad_accum
    tokens_done, timed = 0, 0.0
    for step in range(start, cfg.steps):
        if roll is not None:
            roll.step = step
        began = time.perf_counter()
        reset_traffic()
        set_learning_rate(optimizer, cfg, step)
        tokens, targets = (_rows(t, rank, world) for t in corpus.batch("train", cfg.seed, step, cfg.batch_size, seq_len))
        total = 0.0
        for index in range(cfg.grad_accum):
            model.set_requires_gradient_sync(index == cfg.grad_accum - 1)
            part = slice(index * micro, (index + 1) * micro)
            loss, grads = grad_fn(_ids(tokens[part]), _ids(targets[part]))
            total += float(loss.asnumpy())
        grads, _ = clip_grad_norm(optimizer.parameters, grads, 1.0)
        optimizer(grads)
        if step == cfg.steps - 1 or step == start:
            result.grad_bytes = sum(g.nbytes for g in grads)
        loss_value = _sum_over_ranks(total) / world
        result.losses[step] = loss_value
        result.traffic, result.calls = traffic_bytes(), collective_calls()
        if step > start:  # the first step pays for warm-up
            timed += time.perf_counter() - began
            tokens_done += cfg.batch_size * seq_len
        progress.update(step, loss_value, tokens_done / timed if timed else 0.0, peak_rss_bytes())
        if cfg.checkpoint_dir and cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0:
            save_checkpoint(model, step_dir(cfg.checkpoint_dir, step + 1), optimizer)
            if rank == 0:
                write_run_record(cfg)
    progress.close()
    result.tokens_per_s = tokens_done / timed if timed else 0.0


def evaluate(model, corpus: ByteCorpus, cfg: TrainConfig, seq_len: int, rank: int, world: int) -> float:
    total = 0.0
    for index in range(EVAL_BATCHES):
        tokens, targets = corpus.batch("val", cfg.seed, index, max(world, cfg.batch_size), seq_len)
        total += float(model.loss(_ids(_rows(tokens, rank, world)), _ids(_rows(targets, rank, world))).asnumpy())
    return _sum_over_ranks(total) / world / EVAL_BATCHES


def reference_losses(cfg: TrainConfig) -> dict[int, float]:
    """Single-process training on the same global batches (from step 0), in fp32: what the sharded run must match."""
    import mindspore as ms

    from fullshard.mindspore import clip_grad_norm

    _setup()
    corpus = ByteCorpus.load(cfg.data)
    model = build_model(cfg)
    optimizer = make_optimizer(model.trainable_params(), cfg)
    grad_fn = ms.value_and_grad(lambda x, y: model.loss(x, y), None, optimizer.parameters)
    losses = {}
    for step in range(cfg.steps):
        tokens, targets = corpus.batch("train", cfg.seed, step, cfg.batch_size, model.cfg.seq_len)
        set_learning_rate(optimizer, cfg, step)
        loss, grads = grad_fn(_ids(tokens), _ids(targets))
        grads, _ = clip_grad_norm(optimizer.parameters, grads, 1.0)  # no shards here: a local norm
        optimizer(grads)
        losses[step] = float(loss.asnumpy())
    return losses


def launch(cfg: TrainConfig, nodes: Nodes, run_dir: Path, follow=print) -> list[dict]:
    """Train on this node's msrun workers; the results of every rank on node 0, of this node's ranks on the others
    (raises ``fullshard.train.msrun.WorkerFailed``)."""
    from fullshard.train.msrun import launch as msrun

    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in (*run_dir.glob("result_*.json"), *run_dir.glob("rank_*.pid"), run_dir / PROGRESS_FILE,
                  run_dir / RESULTS_FILE):
        stale.unlink(missing_ok=True)
    (run_dir / CONFIG_FILE).write_text(json.dumps(asdict(cfg)))
    msrun("fullshard.train.worker_mindspore", [str(run_dir / CONFIG_FILE)], nodes.per_node, run_dir, follow=follow,
          follow_file=PROGRESS_FILE, nnodes=nodes.nnodes, node_rank=nodes.node_rank, master_addr=nodes.master_addr,
          master_port=nodes.master_port if nodes.nnodes > 1 else None)
    if nodes.node_rank == 0:
        return json.loads((run_dir / RESULTS_FILE).read_text())
    return [json.loads((run_dir / f"result_{rank}.json").read_text()) for rank in nodes.ranks_on(nodes.node_rank)]


def main(argv: Optional[list[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    config_path = Path(argv[0])
    run_rank(TrainConfig(**json.loads(config_path.read_text())), config_path.parent)


if __name__ == "__main__":
    main()
