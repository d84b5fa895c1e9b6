"""What one all-gather or reduce-scatter costs on this machine, by implementation.

Run: ``.venv/bin/torchrun --nproc_per_node 2 benchmarks/exchange_cost.py [--mib 28]``

Prints, per implementation, the wall time and the CPU time spent by the
calling thread and by the process's other threads (gloo's), averaged over
repetitions on rank 0. On a CPU, communication threads share the cores with
compute, so CPU time is the figure that becomes step time. This is the
measurement behind ``fullshard.plan.exchange`` (docs/performance.md).
"""
from __future__ import annotations

import argparse
import os
import threading
import time

import torch
import torch.distributed as dist

from fullshard.plan import Exchange, reduce_scratch_chunks
from fullshard.torch import collectives
from fullshard.train.procs import exit_skipping_finalization


def other_threads_cpu_s() -> float:
    """CPU seconds of every thread of this process but the calling one (Linux /proc)."""
    me, ticks = threading.get_native_id(), 0
    for task in os.listdir("/proc/self/task"):
        if int(task) == me:
            continue
        try:
            fields = open(f"/proc/self/task/{task}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the thread ended
        ticks += int(fields[11]) + int(fields[12])  # utime + stime
    return ticks / os.sysconf("SC_CLK_TCK")


def _measure(name: str, run, repetitions: int) -> None:
    run()
    dist.barrier()
    wall, mine, others = time.perf_counter(), time.thread_time(), other_threads_cpu_s()
    for _ in range(repetitions):
        run()
    dist.barrier()
    wall = (time.perf_counter() - wall) / repetitions * 1e3
    mine = (time.thread_time() - mine) / repetitions * 1e3
    others = (other_threads_cpu_s() - others) / repetitions * 1e3
    if dist.get_rank() == 0:
        print(f"| {name} | {wall:.1f} | {mine:.1f} | {others:.1f} | {mine + others:.1f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=float, default=28.0, help="full buffer size (all-gather output, reduce-scatter input)")
    parser.add_argument("--repetitions", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    numel = int(args.mib * 2**20 / 4) // world * world
    full, shard = torch.randn(numel), torch.randn(numel // world)
    gathered, reduced = torch.empty(numel), torch.empty(numel // world)
    scratch = [torch.empty(numel // world) for _ in range(reduce_scratch_chunks(Exchange.PAIRWISE, world))]
    if rank == 0:
        print(f"{world} ranks, gloo, {numel * 4 / 2**20:.1f} MiB full buffer, ms per call on rank 0\n")
        print("| implementation | wall | CPU, calling thread | CPU, other threads | CPU, total |")
        print("|---|---:|---:|---:|---:|")
    backend_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    backend_reduce = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    _measure("reduce-scatter: gloo collective", lambda: backend_reduce(reduced, full), args.repetitions)
    _measure("reduce-scatter: pairwise sends (fullshard)", lambda: collectives.reduce_scatter(
        Exchange.PAIRWISE, reduced, full, None, tag=1, scratch=scratch).wait(), args.repetitions)
    _measure("all-gather: gloo collective", lambda: backend_gather(gathered, shard), args.repetitions)
    _measure("all-gather: pairwise sends (fullshard)", lambda: collectives.all_gather(
        Exchange.PAIRWISE, gathered, shard, None, tag=2).wait(), args.repetitions)
    _measure("all-reduce: gloo collective (DDP)", lambda: dist.all_reduce(full), args.repetitions)
    dist.destroy_process_group()
    exit_skipping_finalization(0)


if __name__ == "__main__":
    main()
