"""Where a step's time goes, per library: forward, backward, optimizer; wall time and CPU time.

Run: ``.venv/bin/torchrun --nproc_per_node 2 benchmarks/phases.py [zero3-fp32|zero2-fp32|...] [--steps 6]``

Builds the benchmark's contenders (``fullshard.bench.build_trainer``: same
model, seed and batches), interleaves their steps like the benchmark, and
prints per rank the median of each phase's wall time, of the training
thread's CPU time, and of the other threads' CPU time (gloo's) over the step.
A diagnostic, not the comparison: ratios come from ``python -m fullshard.bench``.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from exchange_cost import other_threads_cpu_s  # the script directory is on sys.path
from fullshard import bench
from fullshard.train.procs import exit_skipping_finalization


def _step(trainer: bench.Trainer, batch) -> list[float]:
    """[forward, backward, optimizer] wall ms, [the same] training-thread CPU ms, other threads' CPU ms."""
    tokens, targets = batch
    marks = [(time.perf_counter(), time.thread_time())]
    others = other_threads_cpu_s()
    logits = trainer.model(tokens)
    loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
    marks.append((time.perf_counter(), time.thread_time()))
    loss.backward()
    marks.append((time.perf_counter(), time.thread_time()))
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)
    marks.append((time.perf_counter(), time.thread_time()))
    others = other_threads_cpu_s() - others
    phases = [[(marks[i + 1][k] - marks[i][k]) * 1e3 for i in range(3)] for k in (0, 1)]
    return phases[0] + phases[1] + [others * 1e3]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", default="zero3-fp32", choices=[c.name for c in bench.configurations()])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--model", default="default", choices=list(bench.MODELS))
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    run = bench.Run(
        bench.MODELS[args.model], torch.device("cpu"), init_device_mesh("cpu", (dist.get_world_size(),)),
        dist.get_rank(), dist.get_world_size(), 4, 0, bench.CollectiveMeter(),
    )
    config = next(c for c in bench.configurations() if c.name == args.config)
    trainers = {c.label: bench.build_trainer(c, config, run) for c in config.contenders}
    samples: dict[str, list[list[float]]] = {label: [] for label in trainers}
    warmup = max(bench.WARMUP_STEPS.values())
    for step in range(warmup + args.steps):
        batch = bench.make_batch(run, step)
        for label, trainer in trainers.items():
            dist.barrier()
            measured = _step(trainer, batch)
            if step >= warmup:
                samples[label].append(measured)
    lines = []
    for label, rows in samples.items():
        m = [statistics.median(row[i] for row in rows) for i in range(7)]
        lines.append(
            f"rank {run.rank} {label:22s} wall fwd/bwd/opt {m[0]:6.0f} {m[1]:6.0f} {m[2]:5.0f} = {sum(m[:3]):6.0f} ms | "
            f"CPU training thread {m[3]:6.0f} {m[4]:6.0f} {m[5]:5.0f} = {sum(m[3:6]):6.0f} | other threads {m[6]:5.0f}"
        )
    gathered: list = [None] * run.world
    dist.all_gather_object(gathered, lines)
    if run.rank == 0:
        print(f"{args.config}: medians over {args.steps} steps after {warmup} warm-up steps")
        print("\n".join(line for rank_lines in gathered for line in rank_lines))
    dist.destroy_process_group()
    exit_skipping_finalization(0)


if __name__ == "__main__":
    main()
