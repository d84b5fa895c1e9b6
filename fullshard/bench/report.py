"""The benchmark reports of both frameworks: tables in Markdown, the JSON and Markdown files.

Framework-free: it reads the summaries the runners (``runner.py`` for torch,
``mindspore_runner.py``) build; ratios and spreads come from ``common.py``.
"""
from __future__ import annotations

import json
from pathlib import Path

from fullshard.bench.common import KINDS

POINT_TO_POINT = "point_to_point"  # bytes sent by isend/send (the torch benchmark's meter)


def mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.1f}"


def ratio(spread: dict) -> str:
    return f"{spread['median']:.2f} ({spread['min']:.2f}-{spread['max']:.2f})"


def header(title: str, meta: dict, setting: str) -> list[str]:
    """The title, the command that reproduces the run, and what it ran on."""
    return [f"# {title} - {meta['date']} on {meta['host']}", "", f"`{meta['command']}`", "", setting, ""]


def section(title: str, columns: str, aligns: str, note: str = "") -> list[str]:
    """A table's heading lines: ``columns`` as "a | b | c", ``aligns`` as "|---|---:|---:|"."""
    return ["", f"## {title}", "", *([note, ""] if note else []), f"| {columns} |", aligns]


def methods(summary: dict) -> list[str]:
    return ["", "## Methods", ""] + [f"- **{key}**: {text}" for key, text in summary["methods"].items()]


def format_markdown(summary: dict) -> str:
    meta = summary["meta"]
    lines = header(
        "fullshard vs FSDP2 vs DDP", meta,
        f"{meta['world_size']} ranks ({meta['backend']}, {meta['device']}, {meta['threads_per_rank']} thread(s)/rank), "
        f"GPT {meta['num_params'] / 1e6:.2f}M params, {meta['batch_per_rank']} sequences/rank, "
        f"untimed warm-up and memory steps before the timed rounds, torch {meta['torch']}, "
        f"fullshard {meta['fullshard']}, ownership sanitizer {'ON' if meta['fullshard_ownership_sanitizer'] else 'off'}.",
    ) + [
        "## Step time (median over rounds; ratios: median of per-round ratios, min-max)",
        "",
        "| config | rounds | library | setup | step ms | fullshard / FSDP2 | fullshard / DDP |",
        "|---|---:|---|---|---:|---:|---:|",
    ]
    for config in summary["configurations"]:
        for label, lib in config["libraries"].items():
            vs_fsdp2 = config["ratios"].get(f"{label}/fsdp2")
            vs_ddp = config["ratios"].get(f"{label}/ddp")
            lines.append(
                f"| {config['name']} | {config['rounds']} | {label} | `{lib['setup']}` | {lib['step_s']['median'] * 1e3:.1f} | "
                f"{ratio(vs_fsdp2) if vs_fsdp2 else ''} | {ratio(vs_ddp) if vs_ddp else ''} |"
            )
    lines += section("Memory per rank, MiB (largest rank)",
                     "config | library | peak in step | held between steps | params+grads+optim | comm peak | "
                     "transient comm peak | peak RSS", "|---|---|---:|---:|---:|---:|---:|---:|")
    for config in summary["configurations"]:
        for label, lib in config["libraries"].items():
            ranks = lib["memory_per_rank"]
            keys = ("peak_bytes", "held_bytes", "comm_peak_bytes", "transient_comm_peak_bytes", "rss_peak_bytes")
            largest = {key: max(r[key] for r in ranks) for key in keys}
            state = max(sum(r["state_bytes"].values()) for r in ranks)
            sampled = "" if lib["library"] == "fullshard" else " *"
            lines.append(
                f"| {config['name']} | {label} | {mib(largest['peak_bytes'])} | {mib(largest['held_bytes'])} | "
                f"{mib(state)} | {mib(largest['comm_peak_bytes'])}{sampled} | "
                f"{mib(largest['transient_comm_peak_bytes'])}{sampled} | {mib(largest['rss_peak_bytes'])} |"
            )
    lines += ["", "\\* sampled estimate (lower bound); fullshard's is its own exact meter."]
    lines += section("Bytes moved per step per rank, MiB",
                     "config | library | all_gather | reduce_scatter | all_reduce | point-to-point | sent (minimum)",
                     "|---|---|---:|---:|---:|---:|---:|",
                     "Collectives by payload (full buffer), measured (theory); point-to-point by bytes sent; "
                     "then all of it as bytes sent per rank, measured (theoretical minimum).")
    for config in summary["configurations"]:
        for label, lib in config["libraries"].items():
            cells = [f"{mib(lib['bytes_per_step'][k])} ({mib(lib['theory_bytes_per_step'][k])})" for k in KINDS]
            cells.append(mib(lib["bytes_per_step"][POINT_TO_POINT]))
            cells.append(f"{mib(lib['sent_per_step'])} ({mib(lib['theory_sent_per_step'])})")
            lines.append(f"| {config['name']} | {label} | " + " | ".join(cells) + " |")
    lines += methods(summary)
    return "\n".join(lines) + "\n"


def write_results(summary: dict, table: str, out_dir: Path) -> tuple[Path, Path]:
    """``<out_dir>/<date>-<host>[-<framework>].json`` (everything) and ``.md`` (the tables)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    framework = summary["meta"].get("framework", "torch")
    stem = f"{summary['meta']['date']}-{summary['meta']['host']}" + ("" if framework == "torch" else f"-{framework}")
    json_path, md_path = out_dir / f"{stem}.json", out_dir / f"{stem}.md"
    json_path.write_text(json.dumps(summary, indent=1))
    md_path.write_text(table)
    return json_path, md_path


def format_markdown_mindspore(summary: dict) -> str:
    """The MindSpore benchmark's tables: step time and ratios, model state against the formula, memory, bytes."""
    meta = summary["meta"]
    [config] = summary["configurations"]
    libraries = config["libraries"]
    lines = header(
        "fullshard.mindspore vs MindSpore data parallel", meta,
        f"{meta['world_size']} msrun workers ({meta['backend']}, {meta['device']}, {meta['threads_per_rank']} op "
        f"thread(s)/worker, {'blocking' if meta.get('blocking_launch') else 'asynchronous'} op launch), GPT {meta['num_params'] / 1e6:.2f}M params, {meta['batch_per_rank']} sequences/worker, "
        f"fp32, one untimed warm-up and one measured step before the timed rounds, MindSpore {meta['mindspore']}, "
        f"fullshard {meta['fullshard']}, comm_fusion={meta['comm_fusion']}, "
        f"ownership sanitizer {'ON' if meta['ownership_sanitizer'] else 'off'}.",
    ) + [
        "## Step time (median over rounds; ratios: median of per-round ratios, min-max)",
        "",
        "| contender | strategy | rounds | step ms | / data parallel | collectives/step | waiting in them, ms |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for label, lib in libraries.items():
        vs = config["ratios"].get(f"{label}/dp")
        lines.append(f"| {label} | `{lib['strategy']}` | {config['rounds']} | {lib['step_s']['median'] * 1e3:.0f} | "
                     f"{ratio(vs) if vs else ''} | {sum(lib['collectives_per_step'].values())} | "
                     f"{lib['collective_wait_s_rank0']['median'] * 1e3:.0f} |")
    lines += section("Model state per rank, MiB (params + grads + optimizer state; largest rank), measured "
                     "(ZeRO formula)", "contender | params | grads | optimizer | total | formula total",
                     "|---|---:|---:|---:|---:|---:|")
    for label, lib in libraries.items():
        state = {key: max(r["state_bytes"][key] for r in lib["memory_per_rank"]) for key in ("params", "grads", "optim")}
        formula = lib["theory_memory"]
        lines.append(
            f"| {label} | {mib(state['params'])} ({mib(formula['params'])}) | {mib(state['grads'])} "
            f"({mib(formula['grads'])}) | {mib(state['optim'])} ({mib(formula['optim'])}) | "
            f"{mib(sum(state.values()))} | {mib(formula['params'] + formula['grads'] + formula['optim'])} |")
    lines += section("Memory per rank, MiB (largest rank)",
                     "contender | fullshard's owned storage, peak in the measured step | formula: unsharded in flight "
                     "| peak RSS", "|---|---:|---:|---:|")
    for label, lib in libraries.items():
        ranks = lib["memory_per_rank"]
        peaks = [r["comm_peak_bytes"] for r in ranks if r["comm_peak_bytes"] is not None]
        lines.append(f"| {label} | {mib(max(peaks)) if peaks else 'no meter'} | "
                     f"{mib(lib['theory_memory']['unsharded'])} | {mib(max(r['rss_peak_bytes'] for r in ranks))} |")
    lines += section("Bytes per step per rank, MiB",
                     "contender | all_gather | reduce_scatter | all_reduce | sent | minimum | CPU emulation",
                     "|---|---:|---:|---:|---:|---:|---:|",
                     "Collectives by payload (full buffer) as they travelled, then what a rank sends: measured, the "
                     "theoretical minimum, and what the CPU emulation carries for that minimum.")
    for label, lib in libraries.items():
        moved = lib["bytes_per_step"]
        lines.append(f"| {label} | " + " | ".join(mib(moved[k]) for k in KINDS) + f" | {mib(lib['sent_per_step'])} | "
                     f"{mib(lib['theory_sent_per_step'])} | {mib(lib['carried_sent_per_step'])} |")
    lines += methods(summary)
    return "\n".join(lines) + "\n"
