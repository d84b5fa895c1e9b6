"""What the benchmarks of both frameworks share: models, how many rounds, paired ratios, the options."""
from __future__ import annotations

import argparse
import statistics
from typing import Sequence

from fullshard.models.config import GPTConfig

MODELS = {
    "default": GPTConfig(vocab_size=8192, seq_len=128, d_model=384, n_layers=6, n_heads=6),
    "tiny": GPTConfig(vocab_size=256, seq_len=32, d_model=64, n_layers=2, n_heads=4),
}
# Without --rounds, each configuration runs as many timed rounds as fit in a
# time budget (estimated from the measured memory step), within these bounds:
# three pairs at least for a median with a spread, and no more than needed.
MIN_ROUNDS, MAX_ROUNDS = 3, 30
DEFAULT_BUDGET_S = {"default": 60.0, "tiny": 1.0}
KINDS = ("all_gather", "reduce_scatter", "all_reduce")  # collectives, by their payload


def spread(values: Sequence[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def paired_ratios(rounds: dict[str, list[float]], pairs: Sequence[tuple[str, str]]) -> dict[str, dict]:
    """``"ours/theirs"`` -> median (min, max) of the per-round ratios: each round times both in turn, so slow
    drift of the machine hits both sides of a pair alike."""
    return {f"{ours}/{theirs}": spread([a / b for a, b in zip(rounds[ours], rounds[theirs])]) for ours, theirs in pairs}


def rounds_for(round_s: float, budget_s: float) -> int:
    """As many rounds of ``round_s`` seconds as fit in the budget, within [MIN_ROUNDS, MAX_ROUNDS]."""
    return int(min(MAX_ROUNDS, max(MIN_ROUNDS, budget_s // max(round_s, 1e-9))))


def add_common_options(parser: argparse.ArgumentParser, models: Sequence[str]) -> None:
    parser.add_argument("--framework", choices=("torch", "mindspore"), default="torch",
                        help="torch: fullshard vs FSDP2 vs DDP; mindspore: fullshard.mindspore vs MindSpore's data parallel")
    parser.add_argument("--nproc", type=int, default=2, help="local processes (default 2)")
    parser.add_argument("--model", choices=sorted(models), default="default", help="default: the benchmark's GPT")
    parser.add_argument("--tiny", action="store_const", const="tiny", dest="model", help="same as --model tiny")
    parser.add_argument("--rounds", type=int,
                        help=f"timed rounds (default: as many as fit in --budget, {MIN_ROUNDS} to {MAX_ROUNDS})")
    parser.add_argument("--budget", type=float, help="seconds of timed rounds per configuration (default 60; 1 with --tiny)")
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per rank (default 4)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=int, default=600, help="collective timeout in seconds")
    parser.add_argument("--out-dir", default="benchmarks/results", help="where the JSON and Markdown go")


def check_common_options(args: argparse.Namespace, prog: str) -> None:
    if args.nproc < 1 or args.batch_size < 1 or (args.rounds is not None and args.rounds < 1):
        raise SystemExit(f"{prog}: --nproc, --batch-size and --rounds must be >= 1")
