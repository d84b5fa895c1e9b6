"""Process helpers the launchers, reports and tests of both frameworks share: a free port, peak RSS, the
processes below a launcher."""
from __future__ import annotations

import os
import resource
import socket
import sys


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now (for a rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def peak_rss_bytes() -> int:
    """This process's peak resident memory so far."""
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss is in KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def reset_peak_rss() -> str:
    """Restart the process's peak-RSS mark where Linux allows it; say what the figure then covers."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        return "process peak RSS during this library's memory phase (mark reset through /proc/self/clear_refs)"
    except OSError:
        return "process peak RSS so far (ru_maxrss; this system cannot reset the mark)"


def descendants(pid: int) -> list[int]:
    """Every living process below ``pid``, children first (Linux ``/proc``; empty elsewhere).

    Read from each process's parent pid, so it also finds the ones that left their parent's
    session or process group (msrun starts every worker with ``setsid``).
    """
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as handle:
                stat = handle.read()
        except OSError:
            continue  # it ended while we looked
        parent = int(stat[stat.rindex(b")") + 2:].split()[1])  # after "pid (comm) state": the ppid
        children.setdefault(parent, []).append(int(entry))
    found, frontier = [], [pid]
    while frontier:
        below = children.get(frontier.pop(0), [])
        found += below
        frontier += below
    return found
