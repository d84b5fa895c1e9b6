"""``fullshard estimate``: memory and traffic per rank from the planning code's formulas, starting no process.

The model is given by its size (``--params``) or counted on the meta device (``--model``, ``--hf-config``,
``--model-class``); an MoE (``--model moe``) is counted per mesh, its experts on their own (``--ep``).
"""
from __future__ import annotations

import os

from fullshard.usage import UsageError, check_common, format_bytes, require_transformers
from fullshard.plan.exchange import DEFAULT_BACKENDS, EXCHANGE_ENV
from fullshard.plan.formulas import gradient_wire_bytes, per_rank_theory
from fullshard.plan.group import Strategy
from fullshard.plan.meshes import MeshShare, mesh_theory


def estimate(args) -> int:
    check_common(args)
    if args.device not in ("cpu", "cuda"):
        raise UsageError(f"unknown --device {args.device!r}; choose cpu or cuda")
    if args.optimizer not in ("adamw", "sgd"):
        raise UsageError(f"unknown --optimizer {args.optimizer!r}; choose adamw or sgd")
    if args.params:
        num_params, root = int(args.params), 0
        largest = int(args.largest_unit) if args.largest_unit else max(1, num_params // 32)
        units = {"num_params": num_params, "largest_unit": largest, "root_params": root}
    else:
        units = _count_model(args)
    _check_estimate_ep(args, units)
    strategy = Strategy.parse(args.strategy)
    grads = "bfloat16" if args.mixed_precision == "bf16" else "float32"

    def reduce_bytes(shards: int) -> int:
        return gradient_wire_bytes(strategy is Strategy.NO_SHARD, DEFAULT_BACKENDS[args.device], args.device, shards,
                                   grads, "float32", os.environ.get(EXCHANGE_ENV))

    theory = _estimate_theory(args, units, strategy, reduce_bytes)
    memory, traffic = theory["total"]["memory"], theory["total"]["traffic"]
    count = units["num_params"]
    print(f"{f'{count / 1e9:.3f}B' if count >= 1e8 else f'{count / 1e6:.3f}M'} parameters, {args.nproc} ranks, {strategy.value}, "
          f"{args.mixed_precision}, {args.optimizer}")
    print("per rank:")
    for key in ("params", "grads", "optim", "unsharded", "total"):
        print(f"  {key:<16}{format_bytes(memory[key])}")
    print("bytes moved per step per rank:")
    for key, value in traffic.items():
        if value:
            print(f"  {key:<16}{format_bytes(value)}")
    for mesh in theory["meshes"]:
        held = sum(mesh["memory"][key] for key in ("params", "grads", "optim"))
        moved = ", ".join(f"{key} {format_bytes(value).strip()}" for key, value in mesh["traffic"].items() if value)
        split = units["roles"][mesh["role"]]["split"]
        print(f"  {mesh['role']:<8}sharded over {mesh['shards']} ranks: {mesh['num_params'] / 1e6:.3f}M parameters"
              f"{f' (1/{split} of them, each ep rank its own)' if split > 1 else ''}, "
              f"params+grads+optim {format_bytes(held).strip()}; moved {moved or 'nothing'}")
    if args.ep > 1:
        print("  (expert parallelism's token all-to-all is not counted here: it depends on the batch; "
              "fullshard train's report measures it)")
    return 0


def _check_estimate_ep(args, units: dict) -> None:
    """--ep N counts an MoE's experts on their own mesh: it needs a model with experts that N divides."""
    if args.ep == 1:
        return
    if args.ep < 1 or "roles" not in units:
        raise UsageError(f"--ep {args.ep}: expert parallelism needs --model moe and an --ep of at least 1")
    if args.strategy == "no_shard":
        raise UsageError(f"--ep {args.ep} shards the experts over a 1-D mesh: it needs a sharding --strategy, "
                         "as fullshard train does")
    # The expert count where the model says it (--model moe), else each unit's expert parameters (--model-class)
    n_experts = units.get("exchange", {}).get("n_experts", 0)
    counts = [n_experts] if n_experts else units["roles"]["experts"]["units"]
    if args.nproc % args.ep or any(count % args.ep for count in counts):
        named = f"the model's {n_experts} experts" if n_experts else "the model's experts"
        raise UsageError(f"--ep {args.ep} must divide --nproc {args.nproc} and {named}")


def _estimate_theory(args, units: dict, strategy: Strategy, reduce_bytes) -> dict:
    """The formulas for the counted model: per mesh for an MoE (``plan.meshes``), else the whole model's."""
    compute = 2 if args.mixed_precision == "bf16" else 4
    optim = 8 if args.optimizer == "adamw" else 0
    if "roles" in units:
        shares = [MeshShare(role, tuple(c["units"]), c["root"], c["split"]) for role, c in units["roles"].items()]
        return mesh_theory(strategy, args.nproc, shares, optim_bytes=optim, compute_bytes=compute,
                           reduce_bytes=reduce_bytes)
    total = per_rank_theory(strategy, args.nproc, units["num_params"], units["largest_unit"], units["root_params"],
                            optim_bytes=optim, compute_bytes=compute, reduce_bytes=reduce_bytes(args.nproc))
    return {"total": total, "meshes": []}


def _count_model(args) -> dict[str, int]:
    """Parameter counts of the model named by --model, --hf-config or --model-class, built on meta."""
    import importlib

    import torch

    from fullshard.models.config import MODEL_SIZES
    from fullshard.train.models import ModelSpec, count_units

    if args.model_class:
        module_name, _, class_name = args.model_class.partition(":")
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError, ValueError) as error:
            raise UsageError(f"--model-class {args.model_class!r}: {error}") from None
        try:
            with torch.device("meta"):
                model = cls()
        except TypeError as error:
            raise UsageError(f"--model-class {args.model_class!r} must build with no arguments: {error}") from None
        if not hasattr(model, "layers"):
            total = sum(p.numel() for p in model.parameters())
            largest = max((sum(p.numel() for p in c.parameters()) for c in model.children()), default=total)
            return {"num_params": total, "largest_unit": largest, "root_params": 0}
        return count_units(model, args.ep)
    if args.hf_config:
        require_transformers()
    elif not args.model:
        raise UsageError("give --params N, --model NAME, --hf-config CONFIG or --model-class module:Class")
    elif args.model not in MODEL_SIZES:
        raise UsageError(f"unknown --model {args.model!r}; choose one of {', '.join(MODEL_SIZES)}")
    with torch.device("meta"):
        return count_units(ModelSpec(args.model or "small", args.hf_config).build(seed=0), args.ep)
