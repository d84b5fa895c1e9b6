"""``fullshard train --framework mindspore``: one msrun worker per rank, its launcher, and the reference.

The same job as the torch worker (``worker.py``): the same global batches
(``data.py``), learning-rate schedule and unit counts (``config.py``), the
GPT written as a MindSpore Cell (``fullshard/models/gpt_mindspore.py``),
``fullshard.mindspore.fully_shard`` per layer and at the root,
``nn.AdamWeightDecay`` (betas 0.9/0.95, weight decay 0.1, as torch's AdamW),
clipping to a global norm of 1, and sharded checkpoints
(``fullshard.mindspore.save_checkpoint``). Each worker writes its result as
JSON into the launch's run directory; rank 0 also writes the progress lines
the launcher prints.
"""
from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Optional

import numpy as np

from fullshard.core.atomic import latest_step, step_dir
from fullshard.core.procs import peak_rss_bytes
from fullshard.models.config import MODEL_SIZES
from fullshard.train.config import EVAL_BATCHES, RankResult, TrainConfig, learning_rate
from fullshard.train.data import ByteCorpus
from fullshard.train.progress import Progress

CONFIG_FILE, PROGRESS_FILE = "config.json", "progress.log"
os.environ.setdefault("GLOG_v", "3")  # MindSpore's own log: errors only (read when MindSpore is imported)


def _setup() -> None:
    import mindspore as ms

    ms.set_context(mode=ms.PYNATIVE_MODE)
    ms.set_device("CPU")
    ms.device_context.cpu.op_tuning.threads_num(1)


def build_model(cfg: TrainConfig):
    from fullshard.models.gpt_mindspore import GPT

    return GPT(MODEL_SIZES[cfg.model], seed=cfg.seed)


def make_optimizer(params, cfg: TrainConfig):
    from mindspore import nn

    return nn.AdamWeightDecay(params, learning_rate=cfg.lr, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


def set_learning_rate(optimizer, cfg: TrainConfig, step: int) -> None:
    import mindspore as ms
    from mindspore import Tensor, ops

    # assign, not set_data: the optimizer's compiled graph holds the Parameter's storage
    ops.assign(optimizer.learning_rate, Tensor(learning_rate(cfg, step), ms.float32))


def shard(model, cfg: TrainConfig):
    import mindspore as ms

    from fullshard.mindspore import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=ms.float16, reduce_dtype=ms.float32) if cfg.mixed_precision == "fp16" else None
    for layer in model.layers:
        fully_shard(layer, mp_policy=mp, strategy=cfg.strategy)
    return fully_shard(model, mp_policy=mp, strategy=cfg.strategy)


def _ids(array: np.ndarray):
    from mindspore import Tensor

    return Tensor(array.astype(np.int32))


def _rows(array: np.ndarray, rank: int, world: int) -> np.ndarray:
    per = array.shape[0] // world
    return array[rank * per:(rank + 1) * per]


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
    """Train on this msrun worker; writes ``result_<rank>.json`` into ``run_dir``."""
    import mindspore as ms
    from mindspore.communication import get_group_size, get_rank, init

    from fullshard.core.msrun import register_worker
    from fullshard.core.traffic import reset_traffic, traffic_bytes
    from fullshard.mindspore import clip_grad_norm, memory_report, save_checkpoint
    from fullshard.models.gpt_mindspore import count_units

    _setup()
    init()
    rank, world = get_rank(), get_group_size()
    register_worker(rank)
    corpus = ByteCorpus.load(cfg.data)
    model = build_model(cfg)
    seq_len = model.cfg.seq_len
    result = RankResult(rank, world, units=count_units(model))
    shard(model, cfg)
    optimizer = make_optimizer(model.trainable_params(), cfg)
    start = resume(cfg, model, optimizer) if cfg.resume else 0
    result.start_step = start
    grad_fn = ms.value_and_grad(lambda x, y: model.loss(x, y) / cfg.grad_accum, None, optimizer.parameters)
    micro = cfg.batch_size // world // cfg.grad_accum
    stream = open(run_dir / PROGRESS_FILE, "a") if rank == 0 else None
    progress = Progress(cfg.steps, start, enabled=rank == 0, stream=stream)
    tokens_done, timed = 0, 0.0
    for step in range(start, cfg.steps):
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
        result.traffic = traffic_bytes()
        if step > start:  # the first step pays for warm-up
            timed += time.perf_counter() - began
            tokens_done += cfg.batch_size * seq_len
        progress.update(step, loss_value, tokens_done / timed if timed else 0.0, peak_rss_bytes())
        if cfg.checkpoint_dir and cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0:
            save_checkpoint(model, step_dir(cfg.checkpoint_dir, step + 1), optimizer)
    progress.close()
    report = memory_report(model, optimizer)
    result.val_loss = evaluate(model, corpus, cfg, seq_len, rank, world)
    result.tokens_per_s = tokens_done / timed if timed else 0.0
    result.param_bytes = report["measured"]["params"]
    result.optim_bytes = report["measured"]["optim"]
    result.theory = report.get("theory")
    result.peak_rss_bytes = peak_rss_bytes()
    (run_dir / f"result_{rank}.json").write_text(json.dumps(asdict(result)))
    if stream is not None:
        stream.close()
    return asdict(result)


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


def launch(cfg: TrainConfig, nproc: int, run_dir: Path, follow=print) -> list[dict]:
    """Train on ``nproc`` msrun workers; every rank's result (raises ``fullshard.core.msrun.WorkerFailed``)."""
    from fullshard.core.msrun import launch as msrun

    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in (*run_dir.glob("result_*.json"), *run_dir.glob("rank_*.pid"), run_dir / PROGRESS_FILE):
        stale.unlink(missing_ok=True)
    (run_dir / CONFIG_FILE).write_text(json.dumps(asdict(cfg)))
    msrun("fullshard.train.worker_mindspore", [str(run_dir / CONFIG_FILE)], nproc, run_dir, follow=follow,
          follow_file=PROGRESS_FILE)
    return [json.loads((run_dir / f"result_{rank}.json").read_text()) for rank in range(nproc)]


def main(argv: Optional[list[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    config_path = Path(argv[0])
    run_rank(TrainConfig(**json.loads(config_path.read_text())), config_path.parent)


if __name__ == "__main__":
    main()
