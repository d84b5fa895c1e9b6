"""The MindSpore benchmark (``fullshard bench --framework mindspore``): fullshard.mindspore ZeRO-3, ZeRO-2 and
ZeRO-1 against MindSpore's own data parallel, on msrun workers.

Every contender trains its own copy of the same seeded GPT Cell
(``fullshard/models/gpt_mindspore.py``) with ``nn.AdamWeightDecay`` on the
same batches:

- ``fullshard:zero3``: ``fully_shard`` per layer and at the root (``optim_grads_params``);
- ``fullshard:zero2``: the same with ``strategy="optim_grads"``;
- ``fullshard:zero1``: the same with ``strategy="optim"`` (one reduction pass at the end of backward);
- ``dp``: the plain Cell, its gradients averaged by ``nn.DistributedGradReducer``
  (one all-reduce per gradient), MindSpore's data parallel in PyNative.

Per contender, untimed: build, one warm-up step, one measured step (model
state by tensor, fullshard's meter, bytes, peak RSS, collectives issued). Then interleaved timed
rounds: one step of each contender per round, the order rotated, all ranks
released together; a round's time is the slowest rank's (gathered at the end),
and ratios are medians of per-round ratios (``common.paired_ratios``). Each
timed step also records the seconds this rank spent inside collectives
(``fullshard.core.buffers.timed``; for data parallel, the reducer's call):
mccl blocks, so that is the wait a schedule can hide or remove.
"""
from __future__ import annotations

import datetime
import gc
import json
import os
import platform
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Optional

import numpy as np

from fullshard.bench.common import (
    DEFAULT_BUDGET_S, KINDS, MIN_ROUNDS, MAX_ROUNDS, add_common_options, check_common_options, paired_ratios,
    rounds_for, spread,
)
from fullshard.bench.report import format_markdown_mindspore, write_results
from fullshard.train.procs import peak_rss_bytes, reset_peak_rss
from fullshard.models.config import MODEL_SIZES, GPTConfig

os.environ.setdefault("GLOG_v", "3")
# PyNative runs op by op: the torch benchmark's 14M GPT would take minutes per round. The project's small GPT.
MODELS = {"default": MODEL_SIZES["small"], "tiny": GPTConfig(vocab_size=256, seq_len=32, d_model=64, n_layers=2,
                                                              n_heads=4)}
CONTENDERS = (("fullshard:zero3", "optim_grads_params"), ("fullshard:zero2", "optim_grads"), ("fullshard:zero1", "optim"),
              ("dp", "no_shard"))
OPTIONS_FILE, FOLLOWED = "options.json", "rank0.log"


# ---------------------------------------------------------------------- one contender
class Trainer:
    def __init__(self, label: str, strategy: str, cfg: GPTConfig, seed: int, world: int, fusion: bool = True) -> None:
        from mindspore import nn

        from fullshard.mindspore import fully_shard
        from fullshard.models.gpt_mindspore import GPT

        self.label, self.strategy = label, strategy
        self.model = GPT(cfg, seed=seed)
        self.sharded = label != "dp"
        if self.sharded:
            for layer in self.model.layers:
                fully_shard(layer, strategy=strategy, comm_fusion=fusion)
            fully_shard(self.model, strategy=strategy, comm_fusion=fusion)
        self.optimizer = nn.AdamWeightDecay(self.model.trainable_params(), learning_rate=3e-4, weight_decay=0.1)
        self.reducer = None if self.sharded else nn.DistributedGradReducer(self.optimizer.parameters, mean=True,
                                                                           degree=world)
        import mindspore as ms

        self._grad = ms.value_and_grad(lambda x, y: self.model.loss(x, y), None, self.optimizer.parameters)
        self.last_grads = ()
        self.reducer_s = 0.0  # dp: the seconds of the last step's gradient averaging (its collectives)

    def step(self, batch: tuple[np.ndarray, np.ndarray]) -> float:
        import mindspore as ms
        from mindspore import Tensor

        tokens, targets = (Tensor(b.astype(np.int32)) for b in batch)
        loss, grads = self._grad(tokens, targets)
        if self.reducer is not None:
            began = time.perf_counter()
            grads = self.reducer(grads)
            ms.runtime.synchronize()
            self.reducer_s = time.perf_counter() - began
        self.optimizer(grads)
        self.last_grads = grads
        value = float(loss.asnumpy())
        ms.runtime.synchronize()
        return value

    def state_bytes(self) -> dict[str, int]:
        """This rank's parameters, gradients and optimizer state per parameter (tensor bytes)."""
        params = list(self.model.get_parameters())
        names = {p.name for p in params}
        own = {id(p) for p in params}
        optim = [p for p in self.optimizer.get_parameters() if id(p) not in own and p.name.partition(".")[2] in names]
        grads = sum(g.nbytes for g in self.last_grads)
        if self.strategy == "optim":  # ZeRO-1 holds the unsharded gradients until the end of backward
            from fullshard.mindspore import memory_report

            grads = memory_report(self.model, self.optimizer)["measured"]["grads_in_backward"]
        return {"params": sum(p.nbytes for p in params), "grads": grads, "optim": sum(p.nbytes for p in optim)}


def make_batch(cfg: GPTConfig, seed: int, step: int, rank: int, world: int, batch_size: int):
    """This rank's batch of a step: the same for every contender (numpy's generator)."""
    rng = np.random.default_rng(seed * 1_000_003 + step * world + rank)
    tokens = rng.integers(0, cfg.vocab_size, (batch_size, cfg.seq_len + 1))
    return tokens[:, :-1], tokens[:, 1:]


def _gather(values: list[float]) -> np.ndarray:
    """Every rank's ``values`` (a row each)."""
    from mindspore import Tensor, ops

    return ops.AllGather()(Tensor(np.array([values], np.float32))).asnumpy()


def _barrier() -> None:
    from mindspore import Tensor, ops

    ops.AllReduce()(Tensor(np.ones(1, np.float32))).asnumpy()


def _theory(trainer: Trainer, world: int, counts: dict) -> dict:
    from fullshard.plan.formulas import report_theory
    from fullshard.mindspore import memory_report
    from fullshard.plan.group import Strategy

    if trainer.sharded:
        return memory_report(trainer.model, trainer.optimizer)["theory"]
    # data parallel: no_shard's formula; an all-reduce travels as it is
    return report_theory(Strategy.NO_SHARD, world, [counts["largest_unit"]], 0,
                         other_params=counts["num_params"] - counts["largest_unit"], param_bytes=4, compute_bytes=4,
                         reduce_bytes=4, adam=True)


def measure(label: str, strategy: str, options: dict, rank: int, world: int, counts: dict) -> tuple[Trainer, dict]:
    from fullshard.core.buffers import collective_calls, reset_traffic, traffic_bytes
    from fullshard.mindspore import comm_bytes, reset_peak_comm_bytes

    cfg = MODELS[options["model"]]
    gc.collect()
    rss_method = reset_peak_rss()
    trainer = Trainer(label, strategy, cfg, options["seed"], world, options["comm_fusion"])
    first_loss = trainer.step(make_batch(cfg, options["seed"], 0, rank, world, options["batch_size"]))
    reset_peak_comm_bytes()
    reset_traffic()
    began = time.perf_counter()
    trainer.step(make_batch(cfg, options["seed"], 1, rank, world, options["batch_size"]))
    elapsed = time.perf_counter() - began
    moved, calls = traffic_bytes(), collective_calls()
    if not trainer.sharded:  # the reducer's all-reduces: one per gradient, each its full size
        moved = {kind: 0 for kind in KINDS}
        moved["all_reduce"] = sum(g.nbytes for g in trainer.last_grads)
        calls = {kind: 0 for kind in KINDS}
        calls["all_reduce"] = len(trainer.last_grads)
    meter = comm_bytes()
    return trainer, {
        "state_bytes": trainer.state_bytes(),
        "theory": _theory(trainer, world, counts),
        "bytes_per_step": moved,
        "collectives_per_step": calls,
        "comm_peak_bytes": meter["peak"] if trainer.sharded else None,
        "comm_live_bytes": meter["live"] if trainer.sharded else None,
        "rss_peak_bytes": peak_rss_bytes(), "rss_method": rss_method,
        "loss_step0": first_loss, "measured_step_s": elapsed,
    }


def worker(options_path: Path) -> None:
    import mindspore as ms
    from mindspore.communication import get_group_size, get_rank, init

    from fullshard.train.msrun import register_worker
    from fullshard.core.buffers import collective_seconds, reset_traffic
    from fullshard.mindspore.cpu import configure_cpu_worker
    from fullshard.models.gpt_mindspore import GPT, count_units

    options = json.loads(options_path.read_text())
    ms.set_context(mode=ms.PYNATIVE_MODE)
    ms.set_device("CPU")
    configure_cpu_worker(options["threads"], options["blocking_launch"])  # every contender alike
    init()
    rank, world = get_rank(), get_group_size()
    register_worker(rank)
    cfg = MODELS[options["model"]]
    counts = count_units(GPT(cfg))
    trainers, memory = {}, {}
    for label, strategy in CONTENDERS:
        trainers[label], memory[label] = measure(label, strategy, options, rank, world, counts)
    measured = _gather([sum(m["measured_step_s"] for m in memory.values())]).max()
    rounds = options["rounds"] or rounds_for(float(measured), options["budget"])
    _say(rank, f"fullshard bench (mindspore): memory measured, timing {rounds} rounds")
    labels = [label for label, _ in CONTENDERS]
    times: dict[str, list[float]] = {label: [] for label in labels}
    waits: dict[str, list[float]] = {label: [] for label in labels}
    losses: dict[str, list[float]] = {label: [] for label in labels}
    for step in range(rounds):
        batch = make_batch(cfg, options["seed"], 2 + step, rank, world, options["batch_size"])
        shift = step % len(labels)
        for label in labels[shift:] + labels[:shift]:
            _barrier()
            reset_traffic()
            began = time.perf_counter()
            losses[label].append(trainers[label].step(batch))
            times[label].append(time.perf_counter() - began)
            waits[label].append(sum(collective_seconds().values()) if trainers[label].sharded
                                else trainers[label].reducer_s)
    # a round's time is the slowest rank's; the wait is rank 0's
    slowest = _gather([t for label in labels for t in times[label]]).max(axis=0).reshape(len(labels), rounds)
    memories = {label: _gather_json(memory[label], label, rank, world) for label in labels}
    if rank == 0:
        summary = summarize(options, counts, world, rounds, labels, slowest, memories, losses, waits)
        table = format_markdown_mindspore(summary)
        json_path, md_path = write_results(summary, table, Path(options["out_dir"]))
        _say(rank, f"{table}\nwrote {json_path} and {md_path}")


def _say(rank: int, text: str) -> None:
    """Rank 0's lines, which the launcher prints as they come."""
    from fullshard.train.msrun import run_dir

    if rank == 0:
        with open(run_dir() / FOLLOWED, "a") as handle:
            handle.write(text + "\n")


def _gather_json(value: dict, key: str, rank: int, world: int) -> list[dict]:
    """Every rank's ``value``, through the run directory (MindSpore has no object collectives on CPU)."""
    from fullshard.train.msrun import run_dir

    name = key.replace(":", "-")
    (run_dir() / f"memory-{name}-{rank}.json").write_text(json.dumps(value))
    _barrier()
    return [json.loads((run_dir() / f"memory-{name}-{r}.json").read_text()) for r in range(world)]


METHODS = {
    "step_time": (
        "forward (value_and_grad) + backward + gradient averaging (dp) + optimizer step + runtime.synchronize, "
        "after a barrier; a round's time is the slowest rank's. Contenders interleaved step by step, order rotated "
        "each round; ratios are the median (min, max) of per-round ratios. Warm-up: one untimed step, then one "
        "measured (untimed for the ratios) step per contender."),
    "model_state": (
        "bytes of this rank's parameters, of the gradients value_and_grad returned (dp: after the reducer; ZeRO-1: "
        "the unsharded gradients it held until the end of backward, fullshard's meter) and of "
        "the optimizer's state per parameter (adam_m, adam_v), next to fullshard.plan.formulas.per_rank_theory "
        "(no_shard's formula for dp)."),
    "bytes": (
        "fullshard: what its collectives really carried in the measured step (fullshard.core.buffers), next to "
        "the strategy's theoretical payload and to what the chosen collectives carry for it (the CPU emulation: "
        "reduce-scatter = all-reduce of the whole buffer, then this rank's chunk). dp: the bytes of the gradients "
        "the reducer all-reduces. Sent per rank: fullshard.plan.formulas.bytes_sent_per_rank of each."),
    "collectives": (
        "collectives per step: the calls fullshard's collectives made in the measured step (fullshard.core.buffers; "
        "dp: one all-reduce per gradient). Wait: the median over timed steps of the wall seconds rank 0 spent "
        "inside them (fullshard: around each blocking mccl call; dp: the reducer's call, synchronized)."),
    "memory": (
        "fullshard: its meter of owned storage (unsharded parameters, communication buffers), peak over the "
        "measured step; MindSpore's data parallel has no such meter. RSS: ru_maxrss after the contender's memory "
        "phase, the mark reset at its start; the process also holds the contenders built before it."),
}


def summarize(options: dict, counts: dict, world: int, rounds: int, labels: list[str], slowest: np.ndarray,
              memories: dict[str, list[dict]], losses: dict[str, list[float]], waits: dict[str, list[float]]) -> dict:
    import mindspore as ms

    import fullshard
    from fullshard.plan.formulas import bytes_sent_per_rank

    libraries = {}
    for index, label in enumerate(labels):
        round_times = [float(t) for t in slowest[index]]
        ranks = memories[label]
        first = ranks[0]
        theory = first["theory"]
        carried = theory.get("carried", theory["traffic"])
        libraries[label] = {
            "strategy": dict(CONTENDERS)[label],
            "step_s": {**spread(round_times), "rounds": round_times},
            "collective_wait_s_rank0": spread(waits[label]),
            "collectives_per_step": first["collectives_per_step"],
            "memory_per_rank": ranks,
            "bytes_per_step": first["bytes_per_step"],
            "theory_bytes_per_step": theory["traffic"],
            "carried_bytes_per_step": carried,
            "sent_per_step": bytes_sent_per_rank(first["bytes_per_step"], world),
            "theory_sent_per_step": theory["sent"],
            "carried_sent_per_step": theory.get("carried_sent", theory["sent"]),
            "theory_memory": theory["memory"],
            "loss_step0_rank0": first["loss_step0"],
            "loss_last_round_rank0": losses[label][-1],
        }
    rounds_by_label = {label: lib["step_s"]["rounds"] for label, lib in libraries.items()}
    ratios = paired_ratios(rounds_by_label, [(label, "dp") for label in labels if label != "dp"])
    return {
        "meta": {
            "framework": "mindspore", "date": datetime.date.today().isoformat(), "host": platform.node(),
            "command": options["command"], "device": "cpu", "backend": "mccl", "world_size": world,
            "threads_per_rank": options["threads"], "blocking_launch": options["blocking_launch"], "mindspore": ms.__version__, "fullshard": fullshard.__version__,
            "model": options["model"], "model_config": asdict(MODELS[options["model"]]), **counts,
            "batch_per_rank": options["batch_size"], "rounds": rounds,
            "optimizer": "AdamWeightDecay(lr=3e-4, weight_decay=0.1), MindSpore defaults otherwise",
            "ownership_sanitizer": os.environ.get("FULLSHARD_CHECK_OWNERSHIP") == "1",
            "comm_fusion": options["comm_fusion"],
        },
        "methods": METHODS,
        "configurations": [{"name": "fp32", "precision": "fp32", "rounds": rounds, "libraries": libraries,
                            "ratios": ratios}],
    }


# ---------------------------------------------------------------------- command line
def main(argv: Optional[list[str]] = None) -> int:
    import argparse

    from fullshard.train.msrun import WorkerFailed, launch

    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="fullshard bench --framework mindspore", description=__doc__.split("\n")[0])
    add_common_options(parser, MODELS)
    parser.add_argument("--threads", type=int, default=1, help="MindSpore op threads per worker (default 1)")
    parser.add_argument("--async-launch", action="store_true",
                        help="keep MindSpore's launch pipeline (queue threads) on; by default ops launch on the "
                             "calling thread, for every contender (fullshard.mindspore.cpu)")
    parser.add_argument("--comm-fusion", action=argparse.BooleanOptionalAction, default=True,
                        help="fully_shard(comm_fusion=...) for every fullshard contender (default on, as fully_shard's "
                             "default); --no-comm-fusion reduces every gradient alone")
    args = parser.parse_args(argv)
    check_common_options(args, "fullshard bench")
    out_dir = Path(args.out_dir).resolve()
    options = {
        "nproc": args.nproc, "model": args.model, "rounds": args.rounds, "seed": args.seed,
        "budget": args.budget if args.budget is not None else DEFAULT_BUDGET_S[args.model],
        "batch_size": args.batch_size, "threads": args.threads, "blocking_launch": not args.async_launch,
        "out_dir": str(out_dir),
        "comm_fusion": args.comm_fusion,
        "command": " ".join(["fullshard bench", *argv]),
    }
    rounds = options["rounds"] or f"up to {options['budget']:g} s of"
    print(f"fullshard bench (mindspore): {args.nproc} msrun workers, model {args.model}, {rounds} timed rounds "
          f"(at least {MIN_ROUNDS}, at most {MAX_ROUNDS})", flush=True)
    import tempfile

    with tempfile.TemporaryDirectory(prefix="fullshard-bench-") as directory:
        (Path(directory) / OPTIONS_FILE).write_text(json.dumps(options))
        try:
            launch("fullshard.bench.mindspore_runner", ["worker", str(Path(directory) / OPTIONS_FILE)], args.nproc,
                   Path(directory), timeout=args.timeout + 60 * (options["rounds"] or MAX_ROUNDS),
                   follow=print, follow_file=FOLLOWED)
        except WorkerFailed as error:
            print(f"fullshard bench: {error}\n{error.log}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["worker"]:
        worker(Path(sys.argv[2]))
    else:
        sys.exit(main())
