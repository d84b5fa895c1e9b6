"""What every collective of this process carried, by kind: bytes, calls and the seconds spent in them.

The meter both runtimes feed. Each collective counts its full buffer
(all-gather output, reduce-scatter input, all-reduce buffer) and one call;
point-to-point sends are counted by the benchmark's own meter. A group of one
rank moves nothing and counts nothing. ``timed`` adds the wall seconds a
blocking collective took (MindSpore's block; torch's run asynchronously, and
the benchmark times their waits itself).
"""
from __future__ import annotations

import contextlib
import time
from collections import Counter
from typing import Iterator

KINDS = ("all_gather", "reduce_scatter", "all_reduce")

traffic: Counter = Counter()  # bytes
calls: Counter = Counter()
seconds: Counter = Counter()


def count(kind: str, nbytes: int) -> None:
    """One collective of ``kind`` carried ``nbytes``."""
    traffic[kind] += nbytes
    calls[kind] += 1


@contextlib.contextmanager
def timed(kind: str) -> Iterator[None]:
    """Add the wall time of the block to ``kind``'s seconds (the time this rank waited in the collective)."""
    start = time.perf_counter()
    try:
        yield
    finally:
        seconds[kind] += time.perf_counter() - start


def reset_traffic() -> None:
    """Start counting afresh (e.g. at the start of a step)."""
    traffic.clear()
    calls.clear()
    seconds.clear()


def traffic_bytes() -> dict[str, int]:
    return {kind: traffic.get(kind, 0) for kind in KINDS}


def collective_calls() -> dict[str, int]:
    return {kind: calls.get(kind, 0) for kind in KINDS}


def collective_seconds() -> dict[str, float]:
    return {kind: seconds.get(kind, 0.0) for kind in KINDS}
