"""Process helpers the launchers, reports and tests of both frameworks share: a free port, peak RSS, the
processes below a launcher, an exit that skips the interpreter's finalization."""
from __future__ import annotations

import os
import resource
import socket
import sys
from typing import NoReturn


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


def exit_skipping_finalization(code: int) -> NoReturn:
    """End a torch.distributed process whose work is done without the interpreter's finalization, as
    a spawned worker ends (multiprocessing's ``os._exit``).

    gloo's worker threads outlive ``destroy_process_group`` (DTensor's sharding caches keep the mesh
    and its groups alive), and one still releasing the tensors of the last ``all_gather_object`` takes
    the GIL while the interpreter finalizes; kineto (the profiler behind the benchmark's memory phase)
    does the same in its exit-time destructors. Either aborts the process ("terminate called without
    an active exception", SIGABRT; about 1 run in 10 on 2 cores, a core dump showed the thread), and
    on several nodes the other agents then wait out torchrun's exit barrier.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
