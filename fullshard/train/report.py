"""The end-of-run report: a table on the terminal, JSON + CSV data, and a PNG of the curves."""
from __future__ import annotations

import csv
import json
import os
from pathlib import Path
from typing import Optional

from fullshard.plan.formulas import gradient_wire_bytes, bytes_sent_per_rank, per_rank_theory
from fullshard.plan.meshes import MeshShare, mesh_theory, sum_meshes, token_exchange_bytes

from fullshard.plan.exchange import DEFAULT_BACKENDS, EXCHANGE_ENV
from fullshard.plan.group import Strategy
from fullshard.train.nodes import choose_mesh, nodes_of


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:8.2f} MiB"


def theoretical(cfg, world: int, units: dict, runtime: Optional[dict] = None, replicas: int = 1) -> dict:
    """What the planning code predicts for this run (per rank), sharded over ``world`` ranks and (HSDP)
    replicated ``replicas`` times.

    ``runtime``: the figures a runtime's ``memory_report`` computed from its own plan (MindSpore's
    include what the CPU emulation carries, and the replicas' all-reduce); without them the torch
    runtime's are worked out here. A model whose ``units`` count parameters per role (an MoE's dense weights
    and experts, ``train.models.count_units``) is counted per mesh (``plan.meshes``): ``meshes`` has each
    role's figures, and the totals are their sums.
    """
    if runtime is not None:
        return {"num_params": units["num_params"], **runtime}
    strategy = Strategy.parse(cfg.strategy)
    # bf16 gradients, unless micro-batches were accumulated without sync (in fp32, the reduce dtype)
    grads = "bfloat16" if cfg.mixed_precision == "bf16" and cfg.grad_accum == 1 else "float32"

    def reduce_bytes(shards: int) -> int:
        return gradient_wire_bytes(strategy is Strategy.NO_SHARD, DEFAULT_BACKENDS[cfg.device], cfg.device, shards,
                                   grads, "float32", os.environ.get(EXCHANGE_ENV))

    compute = 2 if cfg.mixed_precision == "bf16" else 4
    if "roles" in units:
        shares = [MeshShare(role, tuple(c["units"]), c["root"], c["split"]) for role, c in units["roles"].items()]
        theory = mesh_theory(strategy, world, shares, compute_bytes=compute, reduce_bytes=reduce_bytes,
                             micro_batches=cfg.grad_accum, replicas=replicas, replica_reduce_bytes=4)  # fp32 sums
    else:  # one mesh: the whole model
        theory = {"meshes": [], "total": per_rank_theory(
            strategy, world, units["num_params"], units["largest_unit"], units["root_params"], compute_bytes=compute,
            reduce_bytes=reduce_bytes(world), micro_batches=cfg.grad_accum, replicas=replicas,
            replica_reduce_bytes=4)}  # the replicas sum in fp32, the reduce dtype
    total = theory["total"]
    figures = {"num_params": units["num_params"], "memory": total["memory"], "traffic": total["traffic"],
               "replica": total["replica"], "meshes": theory["meshes"]}
    exchange = units.get("exchange")
    if exchange:
        figures["token_exchange"] = token_exchange_bytes(
            cfg.ep, exchange["layers"], cfg.batch_size // (world * replicas) * exchange["seq_len"],
            exchange["top_k"], exchange["width"], compute, exchange["n_experts"], cfg.grad_accum)
    return figures


def mesh_rows(measured: list[dict], formulas: list[dict]) -> list[dict]:
    """Rank 0's measured rows per mesh (each naming the roles of its parameters) next to the formulas of
    those roles added up: a mesh holding several roles (an MoE's experts sharing the dense weights' groups)
    is one row."""
    rows = []
    for mesh in measured:
        formula = sum_meshes([f for f in formulas if f["role"] in mesh["roles"]])
        held = mesh["param_bytes"] + mesh["grad_bytes"] + mesh["optim_bytes"]
        rows.append({"roles": mesh["roles"], "shards": mesh["shards"], "replicas": mesh["replicas"],
                     "held": held, "traffic": mesh["traffic"],
                     "formula": {"held": sum(formula["memory"].get(k, 0.0) for k in ("params", "grads", "optim")),
                                 "traffic": formula["traffic"]}})
    return rows


def _replicas_and_shards(shape: list[int]) -> tuple[int, int]:
    """The ZeRO formulas count the ranks a parameter is sharded over: the mesh's last dim (a node, with HSDP);
    the dim before it, if any, replicates."""
    replicas, shards = ([1] + list(shape))[-2:]
    return replicas, shards


def _mesh(cfg, results: list[dict]) -> dict:
    """The mesh the ranks really sharded on (rank 0's record), with the words for what was chosen."""
    nodes = nodes_of(cfg, results[0]["world"])
    choice = choose_mesh(getattr(cfg, "mesh", "auto"), nodes, cfg.strategy)
    shape = results[0].get("mesh_shape") or list(choice.shape)
    return {"kind": choice.kind, "shape": shape, "dim_names": list(choice.dim_names), "chosen": choice.describe(),
            "placements": results[0].get("placements", "")}


def _nodes(results: list[dict]) -> dict[str, dict]:
    """Per node: its host, its ranks and the launcher agent that started them."""
    nodes: dict[str, dict] = {}
    for r in results:
        node = nodes.setdefault(str(r.get("node", 0)), {"host": r.get("host", ""), "ranks": [], "launcher_pids": []})
        node["ranks"].append(r["rank"])
        if r.get("launcher_pid") and r["launcher_pid"] not in node["launcher_pids"]:
            node["launcher_pids"].append(r["launcher_pid"])
    return nodes


def write_report(cfg, results: list[dict], out_dir: Path, reference: Optional[dict[int, float]] = None) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    world = results[0]["world"]
    first = results[0]
    steps = sorted(int(s) for s in first["losses"])
    losses = [first["losses"][str(s)] if str(s) in first["losses"] else first["losses"][s] for s in steps]
    mesh = _mesh(cfg, results)
    replicas, shards = _replicas_and_shards(mesh["shape"])
    theory = theoretical(cfg, shards, first["units"], first.get("theory"), replicas)
    summary = {
        "config": {k: v for k, v in vars(cfg).items()},
        "framework": getattr(cfg, "framework", "torch"),
        "world_size": world,
        "mesh": mesh,
        "nodes": _nodes(results),
        "steps": steps,
        "train_loss": losses,
        "reference_loss": [reference[s] for s in steps] if reference else None,
        "val_loss": first["val_loss"],
        "tokens_per_s": results[0]["tokens_per_s"],  # global tokens per second, timed on rank 0
        "ranks": [
            {k: r.get(k) for k in ("rank", "node", "host", "param_bytes", "grad_bytes", "optim_bytes",
                                   "peak_rss_bytes", "traffic", "calls", "mesh_shape", "placements", "meshes",
                                   "token_bytes")}
            for r in results
        ],
        "theory": theory,
        "experts": first.get("experts"),
        "meshes": mesh_rows(first.get("meshes") or [], theory.get("meshes") or []) if "roles" in first["units"] else [],
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
    nodes = summary.get("nodes") or {}
    on_nodes = f" on {len(nodes)} nodes" if len(nodes) > 1 else ""
    lines = [
        f"fullshard train: {summary['config']['hf_config'] or summary['config']['model'] + ' GPT'}, "
        f"{theory['num_params'] / 1e6:.2f}M params, "
        f"{summary['world_size']} ranks{on_nodes} ({framework}), strategy {summary['config']['strategy']}, "
        f"{summary['config']['mixed_precision']}",
        f"  train loss   {summary['train_loss'][0]:.4f} -> {summary['train_loss'][-1]:.4f}   "
        f"val loss {summary['val_loss']:.4f}   {summary['tokens_per_s']:.0f} tok/s (all ranks)",
    ]
    if summary.get("mesh"):
        lines.append(f"  mesh         {summary['mesh']['chosen']}")
    ep = summary["config"].get("ep", 1)
    if ep > 1:  # the rows per mesh below count the experts over efsdp, the dense weights over every rank
        lines.append(f"  experts      split over ep groups of {ep} (all-to-all tokens), sharded over efsdp "
                     f"{summary['world_size'] // ep}; gradients divided by {summary['world_size']} (docs/moe.md)")
    experts = summary.get("experts")
    if experts:  # MindSpore: the experts are units of their own on the whole mesh (no all-to-all on its CPU backend)
        lines.append(f"  experts      {experts['experts']} per block (top-{experts['top_k']}), a unit of their own in "
                     f"{experts['units']} blocks ({experts['units_in_all']} units in all), sharded over the same "
                     "mesh as the rest; no token exchange (docs/moe.md)")
    if len(nodes) > 1:
        for node, info in sorted(nodes.items(), key=lambda item: int(item[0])):
            lines.append(f"  node {node}       ranks {', '.join(map(str, info['ranks']))} on {info['host']}")
    if summary.get("max_loss_deviation") is not None:
        lines.append(f"  verify       largest loss deviation from single-process reference: {summary['max_loss_deviation']:.2e}")
    lines.append("  memory/rank  params+grads+optim (measured)   theory (ZeRO formula)   peak RSS")
    for rank in summary["ranks"]:
        held = rank["param_bytes"] + rank["grad_bytes"] + rank["optim_bytes"]
        name = f"rank {rank['rank']}" + (f" (node {rank['node']})" if len(nodes) > 1 else "")
        lines.append(
            f"    {name:<{16 if len(nodes) > 1 else 11}}{_mib(held)}                  "
            f"{_mib(mem['params'] + mem['grads'] + mem['optim'])}            {_mib(rank['peak_rss_bytes'])}"
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
        lines.append(f"    sent/rank      {_mib(_measured_sent(summary, measured))}            "
                     f"{_mib(theory['sent'])}      {_mib(theory['carried_sent'])}")
    lines += _mesh_lines(summary)
    if summary.get("plot"):
        lines.append(f"  plot         {summary['plot']}")
    elif summary.get("plot_skipped"):
        lines.append(f"  plot         skipped: {summary['plot_skipped']}")
    return "\n".join(lines)


def _mesh_lines(summary: dict) -> list[str]:
    """Per mesh (rank 0): the parameters' roles and ranks, bytes held and moved, measured next to the formula;
    their totals; and expert parallelism's token all-to-all."""
    rows = summary.get("meshes") or []
    if not rows:
        return []
    lines = ["  per mesh (rank 0)                    measured         formula"]
    for row in rows:
        over = f"{row['shards']} ranks" + (f" x {row['replicas']} replicas" if row["replicas"] > 1 else "")
        lines.append(f"    {' + '.join(row['roles'])} sharded over {over}")
        lines.append(f"      params+grads+optim         {_mib(row['held'])}     {_mib(row['formula']['held'])}")
        for kind, value in row["formula"]["traffic"].items():
            if value or row["traffic"].get(kind):
                lines.append(f"      {kind:<27}{_mib(row['traffic'].get(kind, 0))}     {_mib(value)}")
    held = sum(row["held"] for row in rows), sum(row["formula"]["held"] for row in rows)
    lines.append(f"    all meshes: params+grads+optim {_mib(held[0])}     {_mib(held[1])}")
    if summary["theory"].get("token_exchange"):
        lines.append(f"    tokens (ep all-to-all)         {_mib(summary['ranks'][0].get('token_bytes') or 0)}     "
                     f"{_mib(summary['theory']['token_exchange'])}")
    return lines


def _measured_sent(summary: dict, measured: dict) -> float:
    """What rank 0 sent for its measured traffic: the shard group's collectives over its S ranks and, with
    HSDP, the replicas' all-reduce (the formula's share of the all-reduce bytes) over the R replicas."""
    replicas, shards = _replicas_and_shards((summary.get("mesh") or {}).get("shape", [summary["world_size"]]))
    across = min(summary["theory"].get("replica", {}).get("all_reduce", 0.0), measured.get("all_reduce", 0))
    in_group = {**measured, "all_reduce": measured.get("all_reduce", 0) - across}
    return bytes_sent_per_rank(in_group, shards) + bytes_sent_per_rank({"all_reduce": across}, replicas)


def format_node_summary(results: list[dict], nodes) -> str:
    """What a node other than node 0 prints at the end: its own ranks (node 0 writes the report)."""
    here = [r for r in results if r["rank"] in nodes.ranks_on(nodes.node_rank)]
    losses = [v for k, v in sorted(here[0]["losses"].items(), key=lambda item: int(item[0]))]
    lines = [f"fullshard train: node {nodes.node_rank} of {nodes.nnodes} finished: ranks "
             f"{', '.join(str(r['rank']) for r in here)} on {here[0].get('host', '')}, train loss "
             f"{losses[0]:.4f} -> {losses[-1]:.4f}; node 0 writes the report (its --out)"]
    for r in here:
        held = r["param_bytes"] + r["grad_bytes"] + r["optim_bytes"]
        lines.append(f"    rank {r['rank']}   params+grads+optim {_mib(held)}   peak RSS {_mib(r['peak_rss_bytes'])}"
                     f"   mesh {'x'.join(map(str, r.get('mesh_shape') or []))} {r.get('placements', '')}")
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
