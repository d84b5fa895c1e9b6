"""The torch benchmark (``python -m fullshard.bench``): fullshard vs PyTorch FSDP2 vs DDP, in one process group.

One invocation starts ``--nproc`` local processes (gloo on CPU, NCCL with
``--device cuda``). For each configuration (ZeRO-3 / ZeRO-2, fp32 / bf16
compute with fp32 reduction) every library gets its own copy of the same
seeded GPT and AdamW, and the step (forward + backward + optimizer step) is
timed in interleaved rounds: one step of each library per round, the order
rotated every round, all ranks released together by a barrier. A round's
time for a library is the slowest rank's; ratios are medians of per-round
ratios, so slow drift of the machine hits both sides of a pair alike.

Measured the same way for every library:

* bytes moved: the ``torch.distributed`` collectives are wrapped before any
  library is imported and every call counts its full buffer (all-gather
  output, reduce-scatter input, all-reduce tensor), the convention of
  ``fullshard.plan.formulas.traffic_bytes_per_step``;
* memory, in untimed steps per library before the rounds (warm-up, then a
  measured step; they also warm the trainer up for timing): on CUDA
  ``torch.cuda.max_memory_allocated``; on CPU the live bytes replayed from the
  PyTorch profiler's allocator events (every tensor allocated since the
  library's model was built: parameters, gradients, optimizer state,
  activations, communication buffers; see :class:`CpuAllocations`), and the
  process's peak RSS.

Transient communication memory cannot be measured the same way for all:
fullshard meters its own buffers (``fullshard.core.buffers.comm_bytes``); for FSDP2
and DDP it is sampled (see :class:`CommSampler`).

Results go to ``<out-dir>/<date>-<host>.json`` and ``.md``.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import os
import platform
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from fullshard.bench.common import (
    DEFAULT_BUDGET_S, KINDS, MAX_ROUNDS, MIN_ROUNDS, MODELS, add_common_options, check_common_options, paired_ratios,
    rounds_for, spread,
)
from fullshard.bench.contenders import (
    TIMED_BATCHES, WARMUP_STEPS, Configuration, Contender, Run, Trainer, build_trainer, configurations, make_batch,
)
from fullshard.bench.meters import (
    CollectiveMeter, CommSampler, CpuAllocations, CudaAllocations, fsdp2_unsharded, storage_bytes, training_state,
)
from fullshard.bench.report import POINT_TO_POINT, format_markdown, write_results
from fullshard.train.procs import exit_skipping_finalization, free_port, peak_rss_bytes, reset_peak_rss
from fullshard.models.gpt import GPT, GPTConfig
from fullshard.plan.formulas import gradient_wire_bytes, bytes_sent_per_rank, per_rank_theory
from fullshard.plan.exchange import DEFAULT_BACKENDS, EXCHANGE_ENV
from fullshard.plan.group import Strategy
from fullshard.train.models import count_units


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _comm_sampler(contender: Contender, trainer: Trainer) -> Optional[CommSampler]:
    """The peers have no meter of their own: sample their communication buffers (None for fullshard)."""
    if contender.library == "fullshard":
        return None
    extra = (lambda: fsdp2_unsharded(trainer.model)) if contender.library == "fsdp2" else list
    sampler = CommSampler(trainer, extra)
    if contender.library == "fsdp2":
        sampler.hook_blocks(trainer.model)
    return sampler


def _comm_peaks(sampler: Optional[CommSampler], comm_base: int, transient_base: int) -> tuple[int, int, str]:
    """Peak communication bytes of the measured step (all, staging only) and how they were measured."""
    from fullshard.torch import collectives

    if sampler is None:
        return (collectives.comm_bytes()["peak"] - comm_base, collectives.comm_bytes()["transient_peak"] - transient_base,
                "fullshard.core.buffers.comm_bytes() peak (its own meter)")
    sampler.close()
    return sampler.peak, sampler.transient_peak, "sampled estimate (lower bound)"


def measure_memory(contender: Contender, config: Configuration, run: Run) -> tuple[Trainer, dict]:
    """Build this library's copy, take its warm-up steps, then measure one step; return the warm trainer.

    These steps are also the warm-up of the timed rounds, which reuse the trainer.
    """
    from fullshard.torch import collectives
    from fullshard.torch.accounting import presence_numel

    gc.collect()
    rss_method = reset_peak_rss()
    # fullshard's meter is process-wide: leave out what the copies built before this one hold.
    comm_base = collectives.comm_bytes()["live"]
    transient_base = collectives.comm_bytes()["transient_live"]
    allocations = CpuAllocations() if run.device.type == "cpu" else CudaAllocations(run.device)
    state: dict[str, int] = {}

    def probe() -> None:
        seen: set[int] = set()
        for kind, tensors in training_state(list(trainer.model.parameters()), trainer.optimizer).items():
            state[kind] = storage_bytes(tensors, seen)

    warmup = WARMUP_STEPS[contender.library]
    with allocations:
        run.meter.watchers.append(allocations.watch)
        trainer = build_trainer(contender, config, run)
        first_loss = trainer.step(make_batch(run, 0)).item()
        for step in range(1, warmup):
            trainer.step(make_batch(run, step))
        sampler = _comm_sampler(contender, trainer)
        collectives.reset_peak_comm_bytes()
        if sampler is not None:
            run.meter.watchers.append(sampler.see)
        batch = make_batch(run, warmup)
        began = time.perf_counter()
        with allocations.measured_step():
            trainer.step(batch, probe)
            _synchronize(run.device)
        elapsed = time.perf_counter() - began
        run.meter.watchers.clear()
    comm_peak, transient_peak, comm_method = _comm_peaks(sampler, comm_base, transient_base)
    return trainer, {
        "peak_bytes": allocations.peak,
        "held_bytes": allocations.held,
        "state_bytes": state,
        "comm_peak_bytes": comm_peak,
        # without the unsharded parameters (which every FSDP holds): staging buffers only
        "transient_comm_peak_bytes": transient_peak,
        "comm_method": comm_method,
        "rss_peak_bytes": peak_rss_bytes(),
        "rss_method": rss_method,
        "loss_step0": first_loss,
        "measured_step_s": elapsed,
        # fullshard's reductions also carry which members each rank had gradients for
        "presence_numel": presence_numel(trainer.model) if contender.library == "fullshard" else 0,
    }


# ---------------------------------------------------------------------- timing
def fit_rounds(step_seconds: list[float], budget_s: float, run: Run) -> int:
    """As many rounds as fit in the budget (judged by the slowest rank), within [MIN_ROUNDS, MAX_ROUNDS]."""
    round_s = torch.tensor([sum(step_seconds)], dtype=torch.float64, device=run.device)
    dist.all_reduce(round_s, op=dist.ReduceOp.MAX)
    return rounds_for(round_s.item(), budget_s)


def time_rounds(trainers: dict[str, Trainer], run: Run, rounds: int) -> dict[str, dict]:
    """Interleave the libraries step by step; return each one's times, bytes and losses on this rank."""
    from fullshard.core.buffers import reset_traffic, traffic as fullshard_traffic

    labels = list(trainers)
    results = {label: {"times": [], "bytes": [], "self_reported": [], "losses": []} for label in labels}
    for step in range(rounds):
        batch = make_batch(run, TIMED_BATCHES + step)
        shift = step % len(labels)  # rotate the order so that no library always goes first
        for label in labels[shift:] + labels[:shift]:
            reset_traffic()
            dist.barrier()
            with run.meter.counting() as moved:
                began = time.perf_counter()
                loss = trainers[label].step(batch)
                _synchronize(run.device)
                elapsed = time.perf_counter() - began
            result = results[label]
            result["times"].append(elapsed)
            result["bytes"].append(dict(moved))
            result["self_reported"].append(dict(fullshard_traffic))
            result["losses"].append(loss.item())
    return results


# ---------------------------------------------------------------------- one rank
def _worker(local_rank: int, options: dict) -> None:
    meter = CollectiveMeter()
    meter.install()  # before anything imports fullshard's runtime
    run = _init(local_rank, options, meter)
    try:
        per_config = [_run_configuration(config, run, options) for config in _selected(options["configs"])]
        gathered: list = [None] * run.world
        dist.all_gather_object(gathered, per_config)
        if run.rank == 0:
            summary = summarize(gathered, run, options)
            table = format_markdown(summary)
            json_path, md_path = write_results(summary, table, Path(options["out_dir"]))
            print(table)
            print(f"wrote {json_path} and {md_path}", flush=True)
    finally:
        dist.destroy_process_group()
    exit_skipping_finalization(0)  # everything is measured and written


def _init(local_rank: int, options: dict, meter: CollectiveMeter) -> Run:
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(options["threads"])
    cuda = options["device"] == "cuda"
    if cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group(
        DEFAULT_BACKENDS[options["device"]], rank=local_rank, world_size=options["nproc"],
        timeout=datetime.timedelta(seconds=options["timeout"]),
    )
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    mesh = init_device_mesh(device.type, (options["nproc"],))
    return Run(
        MODELS[options["model"]], device, mesh, dist.get_rank(), dist.get_world_size(),
        options["batch_size"], options["seed"], meter,
    )


def _progress(run: Run, line: str) -> None:
    if run.rank == 0:
        print(f"fullshard.bench: {line}", flush=True)


def _selected(names: Optional[list[str]]) -> list[Configuration]:
    return [c for c in configurations() if not names or c.name in names]


def _run_configuration(config: Configuration, run: Run, options: dict) -> dict:
    began = time.perf_counter()
    trainers, memory = {}, {}
    for contender in config.contenders:
        trainers[contender.label], memory[contender.label] = measure_memory(contender, config, run)
    rounds = options["rounds"] or fit_rounds([m["measured_step_s"] for m in memory.values()], options["budget"], run)
    _progress(run, f"{config.name}: memory measured, timing {rounds} rounds")
    timing = time_rounds(trainers, run, rounds)
    _progress(run, f"{config.name}: done in {time.perf_counter() - began:.0f} s")
    del trainers
    gc.collect()
    return {"name": config.name, "rounds": rounds, "memory": memory, "timing": timing}


# ---------------------------------------------------------------------- summary and report
def model_counts(cfg: GPTConfig) -> dict[str, int]:
    return count_units(GPT(cfg))


def theory_bytes(contender: Contender, precision: str, run: Run, counts: dict[str, int], presence: int = 0
                 ) -> dict[str, float]:
    bf16 = precision == "bf16" and contender.library != "ddp"
    reduce = 4
    if contender.library == "fullshard":
        # on gloo fullshard sends bf16 gradients and sums them in fp32 (plan.exchange.wire_dtype)
        grads = "bfloat16" if bf16 else "float32"
        reduce = gradient_wire_bytes(
            contender.theory is Strategy.NO_SHARD, dist.get_backend(), run.device.type, run.world, grads, "float32",
            os.environ.get(EXCHANGE_ENV),
        )
    theory = per_rank_theory(
        contender.theory, run.world, counts["num_params"], counts["largest_unit"], counts["root_params"],
        compute_bytes=2 if bf16 else 4, reduce_bytes=reduce, presence_numel=presence,
    )
    return theory["traffic"]


def _summarize_contender(contender: Contender, config: Configuration, ranks: list[dict], run: Run, counts) -> dict:
    timings = [rank["timing"][contender.label] for rank in ranks]
    # A step lasts as long as its slowest rank.
    round_times = [max(times) for times in zip(*(t["times"] for t in timings))]
    steps = timings[0]["bytes"]
    moved = {kind: steps[0].get(kind, 0) for kind in (*KINDS, POINT_TO_POINT)}
    theory = theory_bytes(contender, config.precision, run, counts, ranks[0]["memory"][contender.label]["presence_numel"])
    entry = {
        "library": contender.library,
        "setup": contender.setup,
        "step_s": {**spread(round_times), "rounds": round_times},
        "bytes_per_step": moved,
        "bytes_same_every_step_and_rank": all(s == steps[0] for t in timings for s in t["bytes"]),
        "theory_bytes_per_step": theory,
        # What each rank sends: point-to-point as counted, collectives as a bandwidth-optimal algorithm would.
        "sent_per_step": bytes_sent_per_rank(moved, run.world) + moved[POINT_TO_POINT],
        "theory_sent_per_step": bytes_sent_per_rank(theory, run.world),
        "theory_strategy": contender.theory.value,
        "memory_per_rank": [rank["memory"][contender.label] for rank in ranks],
        # Same weights and batch at step 0 for every library: these should agree.
        "loss_step0_rank0": ranks[0]["memory"][contender.label]["loss_step0"],
        "loss_last_round_rank0": timings[0]["losses"][-1],
    }
    if contender.library == "fullshard":
        reported = timings[0]["self_reported"][0]
        entry["fullshard_self_reported_bytes"] = {kind: reported.get(kind, 0) for kind in KINDS}
    return entry


def _paired_ratios(libraries: dict[str, dict], config: Configuration) -> dict[str, dict]:
    rounds = {label: lib["step_s"]["rounds"] for label, lib in libraries.items()}
    ours = [c.label for c in config.contenders if c.library == "fullshard"]
    return paired_ratios(rounds, [(label, theirs) for label in ours for theirs in ("fsdp2", "ddp")])


def summarize(ranks: list[list[dict]], run: Run, options: dict) -> dict:
    import fullshard
    from fullshard.torch.collectives import check_ownership_enabled

    counts = model_counts(run.model)
    configs = []
    for index, config in enumerate(_selected(options["configs"])):
        per_rank = [rank_results[index] for rank_results in ranks]
        libraries = {c.label: _summarize_contender(c, config, per_rank, run, counts) for c in config.contenders}
        configs.append({
            "name": config.name, "precision": config.precision, "rounds": per_rank[0]["rounds"], "libraries": libraries,
            "ratios": _paired_ratios(libraries, config),
        })
    return {
        "meta": {
            "date": datetime.date.today().isoformat(),
            "host": platform.node(),
            "command": options["command"],
            "device": options["device"],
            "device_name": torch.cuda.get_device_name(run.device) if run.device.type == "cuda" else platform.processor() or platform.machine(),
            "backend": dist.get_backend(),
            "world_size": run.world,
            "threads_per_rank": options["threads"],
            "torch": torch.__version__,
            "fullshard": fullshard.__version__,
            "fullshard_ownership_sanitizer": check_ownership_enabled(),
            "model": options["model"],
            "model_config": asdict(run.model),
            "num_params": counts["num_params"],
            "root_params": counts["root_params"],
            "batch_per_rank": run.batch_size,
            "rounds": options["rounds"] or f"fit to {options['budget']:g} s per configuration, {MIN_ROUNDS} to {MAX_ROUNDS}",
            "optimizer": "AdamW(lr=3e-4, weight_decay=0.1), torch defaults otherwise",
        },
        "methods": METHODS,
        "configurations": configs,
    }


METHODS = {
    "step_time": (
        "forward + backward + optimizer step + zero_grad, after a barrier, per rank; a round's time is the "
        "slowest rank's. Libraries interleaved step by step, order rotated each round; ratios are the median "
        "(min, max) of per-round ratios. Warm-up: the memory phase's steps (one warm-up step, two for DDP, "
        "which rebuilds its buckets in its second iteration, then the measured step). Rounds: --rounds, or as "
        "many as fit in --budget seconds judged by the memory phase's measured steps."
    ),
    "bytes": (
        "torch.distributed collectives and point-to-point sends wrapped before any library runs; each collective "
        "counts its full buffer (all-gather output, reduce-scatter input, all-reduce tensor), each send its "
        "tensor. DDP's C++ all-reduce is replaced by torch's Python allreduce_hook so that it goes through "
        "torch.distributed.all_reduce. Theory: fullshard.plan.formulas.traffic_bytes_per_step (ZeRO-2 rows use "
        "the optim_grads formula). Sent per rank: point-to-point bytes as counted plus, for collectives, what a "
        "bandwidth-optimal algorithm sends (fullshard.plan.formulas.bytes_sent_per_rank: (N-1)/N of an "
        "all-gather or reduce-scatter, 2(N-1)/N of an all-reduce), next to the same function of the theory. "
        "fullshard on gloo exchanges by point-to-point sends (fullshard.plan.exchange), so its bytes show "
        "there; its own logical count by collective is in fullshard_self_reported_bytes."
    ),
    "memory_cpu": (
        "untimed phase per library before the timed rounds: build, warm-up step(s), one measured step, all "
        "under the PyTorch profiler with profile_memory. The allocator events are replayed by address: peak = "
        "the most bytes live during the measured step among those allocated since the build (parameters, "
        "gradients, optimizer state, activations, communication buffers, anything else the library keeps), "
        "held = live at the start of the measured step. Blocks allocated inside a collective by the backend "
        "(gloo's own copies) are excluded, as CUDA's counters exclude NCCL's; the storages passed to collectives "
        "are watched with weakref.finalize, because gloo's threads may drop them where the profiler does not "
        "see the free. state = unique storages of the "
        "local parameters, gradients and optimizer state after optimizer.step()."
    ),
    "memory_cuda": (
        "max_memory_allocated during the measured step minus memory_allocated before this library's build "
        "(the other libraries' models already built stay out); held likewise at the start of the step"
    ),
    "rss": (
        "ru_maxrss after the library's memory phase, the mark reset at its start through /proc/self/clear_refs "
        "where Linux allows; the process also holds the libraries built before it, so it ranks nothing"
    ),
    "comm": (
        "fullshard: fullshard.core.buffers.comm_bytes()['peak'] over the measured step (owned communication storage, "
        "including the unsharded parameters, which are views of owned all-gather outputs). FSDP2: sampled after "
        "every collective and at each block's forward entry/exit: live storages passed to collectives this step "
        "(weakly held) plus every FSDPParam.all_gather_outputs (its unsharded parameters), minus parameter, "
        "gradient and optimizer-state storages; a lower bound. DDP: the same sampling, which finds its gradient "
        "buckets."
    ),
    "ddp_bf16": "DDP keeps fp32 parameters and runs forward under torch.autocast(bfloat16); gradients all-reduced in fp32.",
}


# ---------------------------------------------------------------------- command line
def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m fullshard.bench", description=__doc__.split("\n")[0])
    add_common_options(parser, MODELS)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cpu (gloo) or cuda (NCCL)")
    parser.add_argument("--configs", nargs="+", choices=[c.name for c in configurations()], help="default: all")
    parser.add_argument("--threads", type=int, help="torch threads per rank (default: cores / nproc)")
    return parser


def _options(args: argparse.Namespace, argv: list[str]) -> dict:
    check_common_options(args, "fullshard.bench")
    if args.device == "cuda" and torch.cuda.device_count() < args.nproc:
        raise SystemExit(f"fullshard.bench: --device cuda needs {args.nproc} GPUs, found {torch.cuda.device_count()}")
    return {
        "nproc": args.nproc, "device": args.device, "model": args.model, "rounds": args.rounds,
        "budget": args.budget if args.budget is not None else DEFAULT_BUDGET_S[args.model],
        "batch_size": args.batch_size, "configs": args.configs, "seed": args.seed, "timeout": args.timeout,
        "threads": args.threads or max(1, (os.cpu_count() or 1) // args.nproc),
        "out_dir": str(Path(args.out_dir).resolve()),
        "command": " ".join(["python -m fullshard.bench", *argv]),
    }


def main(argv: Optional[list[str]] = None) -> int:
    from torch.multiprocessing.spawn import ProcessException

    argv = sys.argv[1:] if argv is None else argv
    options = _options(_parser().parse_args(argv), argv)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    os.environ.setdefault("OMP_NUM_THREADS", str(options["threads"]))
    rounds = options["rounds"] or f"up to {options['budget']:g} s of"
    print(f"fullshard.bench: {options['nproc']} processes, model {options['model']}, {rounds} timed rounds "
          "per configuration", flush=True)
    try:
        torch.multiprocessing.start_processes(_worker, args=(options,), nprocs=options["nproc"], start_method="spawn")
    except ProcessException as error:
        print(f"fullshard.bench: a rank failed:\n{error}", file=sys.stderr)
        return 1
    return 0


