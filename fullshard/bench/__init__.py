"""``fullshard bench`` / ``python -m fullshard.bench``: fullshard against the framework's own data parallelism.

- ``--framework torch`` (default; ``runner.py``, with ``contenders.py`` and
  ``meters.py``): fullshard vs PyTorch FSDP2 vs DDP on gloo or NCCL;
- ``--framework mindspore`` (``mindspore_runner.py``): fullshard.mindspore
  ZeRO-3 and ZeRO-2 vs MindSpore's data parallel on msrun workers.

Both interleave the contenders step by step, take ratios as medians of
per-round ratios (``common.py``) and write the same kind of report
(``report.py``). The torch runner's names (``configurations``, ``Run``,
``build_trainer``, ...) stay reachable here, imported when first used.
"""
from __future__ import annotations

import importlib
from typing import Any, Optional


def _framework(argv: list[str]) -> str:
    for index, arg in enumerate(argv):
        if arg == "--framework" and index + 1 < len(argv):
            return argv[index + 1]
        if arg.startswith("--framework="):
            return arg.partition("=")[2]
    return "torch"


def main(argv: Optional[list[str]] = None) -> int:
    import sys

    argv = sys.argv[1:] if argv is None else argv
    runner = "mindspore_runner" if _framework(argv) == "mindspore" else "runner"
    return importlib.import_module(f"fullshard.bench.{runner}").main(argv)


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    runner = importlib.import_module("fullshard.bench.runner")
    try:
        return getattr(runner, name)
    except AttributeError:
        raise AttributeError(f"module 'fullshard.bench' has no attribute {name!r}") from None
