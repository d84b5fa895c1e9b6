"""Bytes every collective of this process carried, by kind: the meter both runtimes feed.

Each collective counts its full buffer (all-gather output, reduce-scatter
input, all-reduce buffer); point-to-point sends are counted by the benchmark's
own meter. A group of one rank moves nothing and counts nothing.
"""
from __future__ import annotations

from collections import Counter

KINDS = ("all_gather", "reduce_scatter", "all_reduce")

traffic: Counter = Counter()


def reset_traffic() -> None:
    """Start counting collective bytes afresh (e.g. at the start of a step)."""
    traffic.clear()


def traffic_bytes() -> dict[str, int]:
    return {kind: traffic.get(kind, 0) for kind in KINDS}
