"""``fullshard`` command line: ``train`` (the main job), ``bench``, ``export`` and ``estimate`` (will it fit?).

``--framework torch`` (the default) or ``mindspore`` picks the runtime for
``train`` and ``bench``; ``export`` recognises either kind of checkpoint.
With MindSpore, ``train`` starts its workers with ``msrun``
(``fullshard/train/worker_mindspore.py``).

``fullshard train`` starts its worker processes through PyTorch's elastic
launcher (the machinery behind ``torchrun``). Started by ``torchrun`` itself
(``RANK`` is set), it trains in the current process instead, so the same
command runs on several machines:

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d \\
        --rdzv-endpoint HOST:29500 -m fullshard train --device cuda

or, on either framework, each node runs ``fullshard train --nnodes 2
--node-rank R --master-addr HOST --master-port P`` (docs/multi-node.md).
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Optional

from fullshard.train.launch import WorkerFailed, run_workers, under_torchrun
from fullshard.train.nodes import DEFAULT_MASTER_PORT, Nodes, NodesError
from fullshard.train.procs import exit_skipping_finalization
from fullshard.usage import STRATEGIES, UsageError, check_common, require_transformers


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fullshard",
                                     description="Fully sharded data parallelism on PyTorch and MindSpore.")
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train a small GPT on text with N sharded processes")
    train.add_argument("--framework", default="torch", help="torch | mindspore (default torch)")
    train.add_argument("--nproc", type=int, default=2, help="processes on this node (default 2)")
    train.add_argument("--nnodes", type=int, help="nodes (machines) in the run, each running this command with "
                       "its own --node-rank (default 1; under torchrun: torchrun's)")
    train.add_argument("--node-rank", type=int, help="this node's rank, 0 to --nnodes - 1 (default 0)")
    train.add_argument("--master-addr", help="node 0's address, which every node can reach (default 127.0.0.1)")
    train.add_argument("--master-port", type=int, help=f"node 0's port for the rendezvous (torch) or msrun's "
                       f"scheduler (mindspore); default {DEFAULT_MASTER_PORT}")
    train.add_argument("--mesh", default="auto", help="auto (hsdp with more than one node, else fsdp) | fsdp "
                       "(shard across every rank) | hsdp (replicate across nodes, shard within each)")
    train.add_argument("--model", default="small", help="tiny | small | medium | moe (default small)")
    train.add_argument("--ep", type=int, default=1, help="--model moe: expert parallelism over N ranks (torch)")
    train.add_argument("--hf-config", help="train a Hugging Face causal LM from a config instead (needs "
                       "transformers): a model type (llama, qwen2, ...), a config.json path or inline JSON")
    train.add_argument("--strategy", default="optim_grads_params", help=" | ".join(STRATEGIES))
    train.add_argument("--mixed-precision", default="fp32", help="fp32 | bf16 (bf16 compute, fp32 reduce; torch) | "
                       "fp16 (fp16 compute, fp32 reduce; mindspore)")
    train.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step")
    train.add_argument("--steps", type=int, default=300)
    train.add_argument("--batch-size", type=int, default=16, help="global batch (sequences per step)")
    train.add_argument("--lr", type=float, default=3e-3)
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--data", nargs="+", help="text files or folders (default: this Python's stdlib sources)")
    train.add_argument("--checkpoint-dir")
    train.add_argument("--checkpoint-every", type=int, default=0)
    train.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    train.add_argument("--verify", action="store_true", help="also train a single-process reference and compare")
    train.add_argument("--device", default="cpu", help="cpu | cuda")
    train.add_argument("--out", default="runs/latest", help="where the report, data and plot go")
    train.add_argument("--timeout", type=int, default=600, help="collective timeout in seconds")

    sub.add_parser("bench", help="fullshard against FSDP2 and DDP (torch) or MindSpore's data parallel "
                   "(--framework mindspore), side by side (see fullshard bench --help)")
    export = sub.add_parser("export", help="write a sharded checkpoint (torch DCP or MindSpore) as one full file")
    export.add_argument("checkpoint", help="a checkpoint directory (e.g. CKPT/step_300)")
    export.add_argument("out", help="output file: .pt, .pth or .safetensors (MindSpore checkpoints: .safetensors)")
    export.add_argument("--key", default="model", help="torch: top-level entry to export ('' for everything; "
                        "default model)")
    export.add_argument("--framework", default="auto", help="auto (from the directory) | torch | mindspore")
    export.add_argument("--without-manifest", action="store_true", help="torch: also export a stock DCP/FSDP2 "
                        "checkpoint, which has no fullshard manifest (every check runs but the digests)")

    _estimate_parser(sub)
    return parser


def _estimate_parser(sub) -> None:
    estimate = sub.add_parser("estimate", help="memory and traffic per rank, from the planning code")
    estimate.add_argument("--params", type=float, help="number of parameters, e.g. 7e9")
    estimate.add_argument("--model", help="count the parameters of a fullshard GPT size instead")
    estimate.add_argument("--hf-config", help="count a Hugging Face model built from this config (on meta)")
    estimate.add_argument("--model-class", help="count module:Class, built with no arguments on the meta device")
    estimate.add_argument("--nproc", type=int, required=True)
    estimate.add_argument("--strategy", default="optim_grads_params")
    estimate.add_argument("--mixed-precision", default="fp32")
    estimate.add_argument("--optimizer", default="adamw", help="adamw | sgd")
    estimate.add_argument("--device", default="cpu", help="cpu (gloo) | cuda (NCCL): how gradients travel")
    estimate.add_argument("--largest-unit", type=float, help="parameters of the largest wrapped unit")
    estimate.add_argument("--ep", type=int, default=1, help="--model moe: experts split over N ranks, sharded "
                          "over nproc/N (each mesh counted on its own)")


def _check_mindspore_moe(args) -> None:
    """The MoE's router and experts have one row per expert: sharded over ranks that do not divide them, the last
    rank holds an empty shard, and MindSpore's optimizers refuse a zero-size Parameter (fully_shard warns)."""
    from fullshard.models.config import MODEL_SIZES

    if args.model != "moe" or args.strategy == "no_shard":
        return
    nodes = args.nnodes or 1
    shard = args.nproc if args.mesh == "hsdp" or (args.mesh == "auto" and nodes > 1) else args.nproc * nodes
    experts = MODEL_SIZES["moe"].n_experts
    if experts % shard:
        raise UsageError(f"--model moe with --framework mindspore shards its {experts} experts over {shard} ranks, "
                         "leaving a rank an empty shard that MindSpore's optimizers refuse; use a number of ranks "
                         f"per shard group that divides {experts}, or --strategy no_shard")


def _check_framework(args) -> None:
    """One line for what the chosen framework cannot do (before anything starts)."""
    import importlib.util

    from fullshard.train.config import FRAMEWORKS

    if args.framework not in FRAMEWORKS:
        raise UsageError(f"unknown --framework {args.framework!r}; choose one of {', '.join(FRAMEWORKS)}")
    if args.framework == "torch":
        if args.mixed_precision == "fp16":
            raise UsageError("--mixed-precision fp16 is for --framework mindspore; torch trains in fp32 or bf16")
        return
    if args.mixed_precision == "bf16":
        raise UsageError("--mixed-precision bf16 with --framework mindspore: MindSpore 2.10 has no bf16 kernels on "
                         "CPU; use fp16 (fp16 compute, fp32 reduce)")
    if args.hf_config:
        raise UsageError("--hf-config builds a Hugging Face torch model; it needs --framework torch")
    if args.ep != 1:
        raise UsageError(f"--ep {args.ep} with --framework mindspore: MindSpore 2.10's CPU backend has no all-to-all "
                         "(AlltoAll, AlltoAllV: no CPU kernel), so experts cannot exchange tokens; drop --ep (the "
                         "experts then shard over every rank, a unit of their own per block) or use --framework torch")
    _check_mindspore_moe(args)
    if args.device != "cpu":
        raise UsageError(f"--device {args.device} with --framework mindspore: the MindSpore job runs on cpu here")
    if importlib.util.find_spec("mindspore") is None:
        raise UsageError("--framework mindspore needs MindSpore: pip install 'fullshard[mindspore]'")




def _nodes(args) -> Nodes:
    """The nodes of this run: torchrun's, when it started this process, else the flags' (checked)."""
    from fullshard.train.nodes import choose_mesh, nodes_from_flags, nodes_from_torchrun

    try:
        if args.framework == "torch" and under_torchrun():
            nodes = nodes_from_torchrun(os.environ, {"nnodes": args.nnodes, "node_rank": args.node_rank})
        else:
            nodes = nodes_from_flags(args.nnodes, args.node_rank, args.nproc, args.master_addr, args.master_port)
        choose_mesh(args.mesh, nodes, args.strategy)
    except NodesError as error:
        raise UsageError(str(error)) from None
    return nodes


def _train_config(args):
    from fullshard.models.config import MODEL_SIZES
    from fullshard.train.config import TrainConfig
    from fullshard.train.data import expand_paths

    check_common(args, ("fp32", "bf16", "fp16"))
    _check_framework(args)
    if args.model not in MODEL_SIZES:
        raise UsageError(f"unknown --model {args.model!r}; choose one of {', '.join(MODEL_SIZES)}")
    if args.device not in ("cpu", "cuda"):
        raise UsageError(f"unknown --device {args.device!r}; choose cpu or cuda")
    nodes = _nodes(args)
    world = nodes.world
    for name in ("steps", "batch_size", "grad_accum"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be at least 1")
    if args.batch_size % (world * args.grad_accum):
        raise UsageError(
            f"--batch-size {args.batch_size} must divide evenly into {world} processes x "
            f"--grad-accum {args.grad_accum} micro-batches"
        )
    if args.data:
        try:
            expand_paths(args.data)
        except FileNotFoundError as error:
            raise UsageError(str(error)) from None
    if args.hf_config:
        require_transformers()
    if (args.resume or args.checkpoint_every) and not args.checkpoint_dir:
        raise UsageError("--resume and --checkpoint-every need --checkpoint-dir")
    cfg = TrainConfig(
        model=args.model, hf_config=args.hf_config, strategy=args.strategy, mixed_precision=args.mixed_precision, grad_accum=args.grad_accum,
        steps=args.steps, batch_size=args.batch_size, lr=args.lr, seed=args.seed, data=args.data,
        checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every, resume=args.resume,
        out_dir=args.out, device=args.device, timeout_s=args.timeout, framework=args.framework,
        mesh=args.mesh, nodes=asdict(nodes), ep=args.ep,
    )
    _check_expert_parallel(cfg, MODEL_SIZES[args.model].n_experts, world)
    return cfg


def _check_expert_parallel(cfg, n_experts: int, world: int) -> None:
    """--ep N: the experts split over N ranks of every group of N, the rest sharded over all (docs/moe.md)."""
    from fullshard.train.nodes import choose_mesh

    if cfg.ep == 1:
        return
    if cfg.ep < 1 or not n_experts or cfg.hf_config:
        raise UsageError(f"--ep {cfg.ep}: expert parallelism needs --model moe and an --ep of at least 1")
    if world % cfg.ep or n_experts % cfg.ep:
        raise UsageError(f"--ep {cfg.ep} must divide the {world} processes and the model's {n_experts} experts")
    if cfg.strategy == "no_shard" or choose_mesh(cfg.mesh, Nodes(**cfg.nodes), cfg.strategy).kind != "fsdp":
        raise UsageError(f"--ep {cfg.ep} shards over a 1-D mesh (--mesh fsdp) with a sharding --strategy")






def _check_run_record(cfg) -> None:
    """``--resume`` into checkpoints of another model (the directory's run record says which) is one line
    before any worker starts, not a worker's traceback."""
    from fullshard.train.config import run_record_mismatch

    mismatch = run_record_mismatch(cfg)
    if mismatch:
        raise UsageError(f"--resume: {mismatch}")


def _check_resumable(checkpoint_dir: str, framework: str) -> int:
    """The step of the checkpoint ``--resume`` will load, checked here as the workers will check it: a bad one
    is one line before any worker starts, not a worker's traceback."""
    from fullshard.checkpoint import CheckpointError, latest_step, step_dir

    step = latest_step(checkpoint_dir)
    if step is None:
        raise UsageError(f"--resume: no complete checkpoint under {checkpoint_dir}")
    try:
        if framework == "mindspore":
            from fullshard.checkpoint.formats.sharded_safetensors import ShardedCheckpoint

            ShardedCheckpoint(step_dir(checkpoint_dir, step))
        else:
            from fullshard.torch.checkpoint import read_metadata

            read_metadata(step_dir(checkpoint_dir, step))
    except CheckpointError as error:
        raise UsageError(f"--resume: {one_line(error)}") from None
    return step


def _resume_start(cfg) -> int:
    """The step ``--resume`` continues from, after the launcher's checks (a bad start is one line)."""
    _check_run_record(cfg)
    return _check_resumable(cfg.checkpoint_dir, cfg.framework)










def train(args) -> int:
    cfg = _train_config(args)
    start = _resume_start(cfg) if cfg.resume else 0
    if start >= cfg.steps:  # no worker: it would train no step and overwrite the finished run's report
        print(f"fullshard train: the checkpoint under {cfg.checkpoint_dir} is at step {start} and --steps is "
              f"{cfg.steps}: nothing to train; {cfg.out_dir} is left as it was (pass a larger --steps to train on)")
        return 0
    from fullshard.train.report import format_node_summary, format_table, write_report

    nodes = Nodes(**cfg.nodes)
    results = run_workers(cfg, nodes)
    if results is None:
        return 0
    if nodes.node_rank != 0:  # the report is node 0's; this node says how its own ranks did
        print(format_node_summary(results, nodes))
        return 0
    if cfg.framework == "mindspore":
        from fullshard.train.worker_mindspore import reference_losses
    else:
        from fullshard.train.worker import reference_losses
    reference = None
    if args.verify:
        print(f"verify: training the single-process reference on the same {cfg.steps} global batches ...", flush=True)
        reference = reference_losses(cfg)
    summary = write_report(cfg, results, Path(cfg.out_dir), reference)
    print(format_table(summary))
    if reference is not None:
        tolerance = 5e-2 if cfg.mixed_precision in ("bf16", "fp16") else 1e-3
        if summary["max_loss_deviation"] > tolerance:
            print(f"verify FAILED: loss deviates by {summary['max_loss_deviation']:.3g} > {tolerance}", file=sys.stderr)
            return 1
        print(f"verify passed (tolerance {tolerance})")
    return 0


def export(args) -> int:
    """One process, no process group: check the whole checkpoint, read the shards, write the full state dict.

    Every problem with the checkpoint is one line (a UsageError), never a traceback.
    """
    from fullshard.checkpoint import CheckpointError

    if args.framework not in ("auto", "torch", "mindspore"):
        raise UsageError(f"unknown --framework {args.framework!r}; choose auto, torch or mindspore")
    try:
        path = _resolved_checkpoint(args.checkpoint)
        framework = _checkpoint_framework(path) if args.framework == "auto" else args.framework
        written = (_export_mindspore(args, path) if framework == "mindspore" else _export_torch(args, path))
    except (CheckpointError, ValueError, OSError, ImportError) as error:
        raise UsageError(one_line(error)) from None
    print(f"wrote {written}")
    return 0


def one_line(error: BaseException) -> str:
    """An error's message on one line (a mismatch lists its problems on several)."""
    return "; ".join(line.strip() for line in str(error).splitlines() if line.strip()) or type(error).__name__


def _resolved_checkpoint(path: str) -> Path:
    """The directory ``path`` is loaded from, as every loader finds it; a recovered one is said in one line."""
    import warnings

    from fullshard.checkpoint import RecoveredCheckpointWarning, resolve

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RecoveredCheckpointWarning)
        resolved = resolve(path)
    for warning in caught:
        print(f"fullshard export: warning: {warning.message}", file=sys.stderr)
    return resolved


def _checkpoint_framework(path: Path) -> str:
    """Which runtime wrote checkpoint ``path``: its manifest says so; without one, its metadata file does."""
    from fullshard.checkpoint import manifest
    from fullshard.checkpoint.formats import sharded_safetensors

    if manifest.present(path):
        return manifest.read(path).framework
    if sharded_safetensors.is_sharded_checkpoint(path):
        return "mindspore"
    if not Path(path, ".metadata").is_file():
        raise UsageError(f"{path} is not a complete checkpoint directory (no {manifest.MANIFEST_FILE}, no "
                         f".metadata, nor a MindSpore {sharded_safetensors.METADATA_FILE})")
    return "torch"


def _export_mindspore(args, path: Path) -> Path:
    from fullshard.checkpoint import manifest
    from fullshard.checkpoint.formats import sharded_safetensors

    if not (sharded_safetensors.is_sharded_checkpoint(path) or manifest.present(path)):
        raise UsageError(f"{path} is not a complete MindSpore checkpoint directory "
                         f"(no {sharded_safetensors.METADATA_FILE})")
    if args.key not in ("model", ""):
        raise UsageError("--key selects an entry of a torch checkpoint; a MindSpore export holds the model")
    return sharded_safetensors.export_full(path, args.out)  # numpy and safetensors: no MindSpore needed


def _export_torch(args, path: Path) -> Path:
    from fullshard.torch.checkpoint import export_checkpoint

    return export_checkpoint(path, args.out, key=args.key or None, require_manifest=not args.without_manifest)


def _estimate(args) -> int:
    from fullshard.estimate import estimate

    return estimate(args)


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # the benchmark has its own options (python -m fullshard.bench --help)
        from fullshard.bench import main as bench_main

        return bench_main(argv[1:])
    args = _parser().parse_args(argv)
    try:
        code = {"train": train, "estimate": _estimate, "export": export}[args.command](args)
    except UsageError as error:
        print(f"fullshard {args.command}: error: {error}", file=sys.stderr)
        code = 2
    except WorkerFailed as error:
        print(f"fullshard {args.command}: {error}", file=sys.stderr)
        code = 1
    if args.command == "train" and under_torchrun():
        exit_skipping_finalization(code)
    return code

