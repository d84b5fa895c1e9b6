"""The end-of-run report: a table on the terminal, JSON + CSV data, and a PNG of the curves."""
from __future__ import annotations

import csv
import json
import os
from pathlib import Path
from typing import Optional

from fullshard.plan.exchange import DEFAULT_BACKENDS, EXCHANGE_ENV, gradient_wire_bytes
from fullshard.plan.strategy import Strategy, bytes_sent_per_rank, per_rank_theory


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:8.2f} MiB"


def theoretical(cfg, world: int, units: dict[str, int], runtime: Optional[dict] = None) -> dict:
    """What the planning code predicts for this run (per rank).

    ``runtime``: the figures a runtime's ``memory_report`` computed from its own plan (MindSpore's
    include what the CPU emulation carries); without them the torch runtime's are worked out here.
    """
    if runtime is not None:
        return {"num_params": units["num_params"], **runtime}
    strategy = Strategy.parse(cfg.strategy)
    # bf16 gradients, unless micro-batches were accumulated without sync (in fp32, the reduce dtype)
    grads = "bfloat16" if cfg.mixed_precision == "bf16" and cfg.grad_accum == 1 else "float32"
    reduce_bytes = gradient_wire_bytes(
        strategy is Strategy.NO_SHARD, DEFAULT_BACKENDS[cfg.device], cfg.device, world, grads, "float32",
        os.environ.get(EXCHANGE_ENV),
    )
    theory = per_rank_theory(
        strategy, world, units["num_params"], units["largest_unit"], units["root_params"],
        compute_bytes=2 if cfg.mixed_precision == "bf16" else 4, reduce_bytes=reduce_bytes,
        micro_batches=cfg.grad_accum,
    )
    return {"num_params": units["num_params"], "memory": theory["memory"], "traffic": theory["traffic"]}


def write_report(cfg, results: list[dict], out_dir: Path, reference: Optional[dict[int, float]] = None) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    world = results[0]["world"]
    first = results[0]
    steps = sorted(int(s) for s in first["losses"])
    losses = [first["losses"][str(s)] if str(s) in first["losses"] else first["losses"][s] for s in steps]
    theory = theoretical(cfg, world, first["units"], first.get("theory"))
    summary = {
        "config": {k: v for k, v in vars(cfg).items()},
        "framework": getattr(cfg, "framework", "torch"),
        "world_size": world,
        "steps": steps,
        "train_loss": losses,
        "reference_loss": [reference[s] for s in steps] if reference else None,
        "val_loss": first["val_loss"],
        "tokens_per_s": results[0]["tokens_per_s"],  # global tokens per second, timed on rank 0
        "ranks": [
            {k: r[k] for k in ("rank", "param_bytes", "grad_bytes", "optim_bytes", "peak_rss_bytes", "traffic")}
            for r in results
        ],
        "theory": theory,
    }
    if reference:
        summary["max_loss_deviation"] = max(abs(a - b) for a, b in zip(losses, summary["reference_loss"]))
    (out_dir / "report.json").write_text(json.dumps(summary, indent=1))
    with open(out_dir / "losses.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["step", "train_loss", "reference_loss"])
        for index, step in enumerate(steps):
            writer.writerow([step, losses[index], reference[step] if reference else ""])
    summary["plot"], summary["plot_skipped"] = _plot(summary, out_dir / "report.png")
    return summary


def format_table(summary: dict) -> str:
    theory = summary["theory"]
    mem, traffic = theory["memory"], theory["traffic"]
    framework = summary.get("framework", "torch")
    lines = [
        f"fullshard train: {summary['config']['hf_config'] or summary['config']['model'] + ' GPT'}, "
        f"{theory['num_params'] / 1e6:.2f}M params, "
        f"{summary['world_size']} ranks ({framework}), strategy {summary['config']['strategy']}, "
        f"{summary['config']['mixed_precision']}",
        f"  train loss   {summary['train_loss'][0]:.4f} -> {summary['train_loss'][-1]:.4f}   "
        f"val loss {summary['val_loss']:.4f}   {summary['tokens_per_s']:.0f} tok/s (all ranks)",
    ]
    if summary.get("max_loss_deviation") is not None:
        lines.append(f"  verify       largest loss deviation from single-process reference: {summary['max_loss_deviation']:.2e}")
    lines.append("  memory/rank  params+grads+optim (measured)   theory (ZeRO formula)   peak RSS")
    for rank in summary["ranks"]:
        held = rank["param_bytes"] + rank["grad_bytes"] + rank["optim_bytes"]
        lines.append(
            f"    rank {rank['rank']}     {_mib(held)}                  {_mib(mem['params'] + mem['grads'] + mem['optim'])}"
            f"            {_mib(rank['peak_rss_bytes'])}"
        )
    carried = theory.get("carried")
    emulation = "   CPU emulation carries" if carried else ""
    lines.append(f"  traffic/step measured (rank 0)        theory (minimum){emulation}")
    measured = summary["ranks"][0]["traffic"]
    for kind in ("all_gather", "reduce_scatter", "all_reduce"):
        if measured.get(kind) or traffic.get(kind) or (carried and carried.get(kind)):
            extra = f"      {_mib(carried.get(kind, 0))}" if carried else ""
            lines.append(f"    {kind:<15}{_mib(measured.get(kind, 0))}            {_mib(traffic[kind])}{extra}")
    if carried:
        lines.append(f"    sent/rank      {_mib(bytes_sent_per_rank(measured, summary['world_size']))}            "
                     f"{_mib(theory['sent'])}      {_mib(theory['carried_sent'])}")
    if summary.get("plot"):
        lines.append(f"  plot         {summary['plot']}")
    elif summary.get("plot_skipped"):
        lines.append(f"  plot         skipped: {summary['plot_skipped']}")
    return "\n".join(lines)


PLOT_SKIPPED = "matplotlib is not installed; pip install matplotlib (or fullshard[plot]) to get report.png"


def _plot(summary: dict, path: Path) -> tuple[Optional[str], Optional[str]]:
    """(the PNG written, None), or (None, why it was skipped)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None, PLOT_SKIPPED
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.plot(summary["steps"], summary["train_loss"], label=f"fullshard.{summary.get('framework', 'torch')} (sharded)")
    if summary.get("reference_loss"):
        left.plot(summary["steps"], summary["reference_loss"], "--", label="single-process reference")
    left.axhline(summary["val_loss"], color="gray", linestyle=":", label=f"final val loss {summary['val_loss']:.3f}")
    left.set_xlabel("step")
    left.set_ylabel("cross-entropy (nats/byte)")
    left.set_title("loss")
    left.legend()
    ranks = [r["rank"] for r in summary["ranks"]]
    bottoms = [0.0] * len(ranks)
    for key, label in (("param_bytes", "params"), ("grad_bytes", "grads"), ("optim_bytes", "optimizer")):
        values = [r[key] / 2**20 for r in summary["ranks"]]
        right.bar(ranks, values, bottom=bottoms, label=label)
        bottoms = [b + v for b, v in zip(bottoms, values)]
    mem = summary["theory"]["memory"]
    right.axhline((mem["params"] + mem["grads"] + mem["optim"]) / 2**20, color="black", linestyle="--", label="ZeRO formula")
    right.set_xlabel("rank")
    right.set_ylabel("MiB held")
    right.set_xticks(ranks)
    right.set_title(f"per-rank memory ({summary['config']['strategy']})")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path), None
