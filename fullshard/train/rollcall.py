"""The roll call of a multi-node run: when ranks are lost, every other rank stops at once, naming them.

A rank on another machine is invisible to this node's launcher, and neither
framework names a rank that died: gloo fails the next collective with
"Connection reset by peer" and no rank; MindSpore's CPU collectives wait until
msrun's scheduler misses a heartbeat (about 30 s), then name only the first
rank that timed out. So each rank of a multi-node run keeps one TCP connection
to rank 0 (the hub) for the whole run. When a process dies its kernel closes
the socket, so the hub learns of it at once; TCP keepalive finds a host that
stopped answering (power, network) in about 15 s. The hub waits a moment for
the rest of that node's ranks, tells every remaining rank who was lost, and
each rank stops with exit status :data:`LOST_EXIT_CODE`; the first rank of
each node prints the one line and leaves it in ``<out>/lost_ranks.json`` for
its launcher. A rank that loses the hub names rank 0.

Framework-free: each job passes ``share``, its own broadcast of a string
from rank 0, through which the other ranks learn the hub's address.
"""
from __future__ import annotations

import contextlib
import json
import os
import selectors
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Iterator, Optional

from fullshard.train.config import TrainConfig, last_checkpoint_hint
from fullshard.train.nodes import describe_ranks, nodes_of

LOST_EXIT_CODE = 75  # sysexits' EX_TEMPFAIL: try again (--resume)
LOST_FILE = "lost_ranks.json"
# Set by fullshard train when it is the launcher: it prints the line itself, so the workers only leave the file
LAUNCHER_REPORTS_ENV = "FULLSHARD_LAUNCHER_REPORTS"
DONE = "done"  # the line of a rank's normal end (to the hub), or of the hub's (to every rank)
GATHER_S = 1.0  # after the first loss, how long the hub waits for the rest of a node's ranks
SPEAK_FIRST_S = 2.0  # how long the other ranks of a node wait for its first rank to say who was lost


def _keepalive(sock: socket.socket) -> None:
    """Probe an idle connection after 5 s, every 2 s, 3 times: a silent host is lost within about 15 s."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 5), ("TCP_KEEPINTVL", 2), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def address_toward(host: str) -> str:
    """This machine's address on the route to ``host`` (the master): one the other nodes can reach."""
    try:
        family, kind, _, _, target = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, kind) as probe:
            probe.connect(target)  # a UDP "connect" sends nothing; it only picks the route
            return probe.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())


def _read_lines(sock: socket.socket, buffer: bytearray) -> Optional[list[str]]:
    """The complete lines that arrived (None: the connection ended or failed)."""
    try:
        data = sock.recv(4096)
    except OSError:
        return None
    if not data:
        return None
    buffer.extend(data)
    *lines, rest = buffer.split(b"\n")
    buffer[:] = rest
    return [line.decode() for line in lines]


class RollCall:
    """This rank's end of the roll call. ``on_lost({rank: node})`` runs once, on the watcher thread."""

    def __init__(self, rank: int, on_lost: Callable[[dict[int, int]], None]) -> None:
        self.rank = rank
        self._on_lost = on_lost
        self._finished = threading.Event()
        self._verdict, self._reported = threading.Event(), threading.Event()
        self._peers: dict[socket.socket, tuple[int, int]] = {}  # hub: connection -> (rank, node)
        self._hub: Optional[socket.socket] = None
        self.step: Optional[int] = None  # the step in progress, for the line (set by the training loop)
        self._wake_r, self._wake_w = socket.socketpair()  # finish() wakes the hub's watcher with it

    @classmethod
    def start(cls, rank: int, node: int, world: int, share: Callable[[str], str], master_addr: str,
              on_lost: Callable[[dict[int, int]], None], timeout: float = 600.0) -> "RollCall":
        """Every rank calls it at the same point (``share`` is a collective); returns once all are connected."""
        call = cls(rank, on_lost)
        if rank == 0:
            family = socket.AF_INET6 if socket.has_dualstack_ipv6() else socket.AF_INET
            with socket.create_server(("", 0), family=family, dualstack_ipv6=family == socket.AF_INET6) as server:
                share(f"{address_toward(master_addr)} {server.getsockname()[1]}")
                server.settimeout(timeout)
                call._accept(server, world - 1)
            watch = call._watch_peers
        else:
            host, port = share("").split()
            call._hub = socket.create_connection((host, int(port)), timeout=timeout)
            call._hub.settimeout(None)
            _keepalive(call._hub)
            call._hub.sendall(f"{rank} {node}\n".encode())
            watch = call._watch_hub
        threading.Thread(target=watch, name="fullshard-rollcall", daemon=True).start()
        return call

    def _accept(self, server: socket.socket, count: int) -> None:
        """Each rank connects and says "<rank> <node>" (within the server's timeout)."""
        for _ in range(count):
            conn, _ = server.accept()
            conn.settimeout(server.gettimeout())
            buffer = bytearray()
            lines: Optional[list[str]] = []
            while lines == []:
                lines = _read_lines(conn, buffer)
            if not lines:
                raise ConnectionError("roll call: a rank connected and left before saying who it is")
            conn.settimeout(None)
            _keepalive(conn)
            rank, node = map(int, lines[0].split())
            self._peers[conn] = (rank, node)

    def _watch_peers(self) -> None:
        try:
            lost = self._collect_lost()
        except (OSError, ValueError):  # finish() closed the connections under the selector
            return
        if lost:
            self._announce(lost)

    def _collect_lost(self) -> dict[int, int]:
        """Wait for ranks that end without saying done, and for the rest of their node (GATHER_S)."""
        selector = selectors.DefaultSelector()
        selector.register(self._wake_r, selectors.EVENT_READ)
        for conn in self._peers:
            selector.register(conn, selectors.EVENT_READ, bytearray())
        lost: dict[int, int] = {}
        deadline = None
        while not self._finished.is_set():
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            for key, _ in selector.select(timeout):
                if key.fileobj is self._wake_r:
                    continue
                lines = _read_lines(key.fileobj, key.data)
                if lines is None or DONE in lines:
                    selector.unregister(key.fileobj)
                if lines is None:  # it ended without saying done: lost
                    lost.update([self._peers[key.fileobj]])
                    deadline = deadline or time.monotonic() + GATHER_S
            if deadline is not None and time.monotonic() >= deadline:
                return lost
        return {}

    def _announce(self, lost: dict[int, int]) -> None:
        """Tell the ranks still connected who was lost, then stop this one."""
        line = ("lost " + ",".join(f"{r}:{n}" for r, n in sorted(lost.items())) + "\n").encode()
        for conn, (rank, _) in self._peers.items():
            if rank not in lost:
                try:
                    conn.sendall(line)
                except OSError:
                    pass
        self._report(lost)

    def _watch_hub(self) -> None:
        buffer = bytearray()
        while True:
            lines = _read_lines(self._hub, buffer)
            if self._finished.is_set() or (lines and DONE in lines):
                return
            if lines is None:
                self._report({0: 0})  # rank 0 is on node 0 by the numbering of every launcher
                return
            for line in lines:
                if line.startswith("lost "):
                    pairs = (item.split(":") for item in line[len("lost "):].split(","))
                    self._report({int(r): int(n) for r, n in pairs})
                    return

    def _report(self, lost: dict[int, int]) -> None:
        if self._finished.is_set():
            return
        self._verdict.set()
        self._on_lost(lost)  # the job's on_lost ends the process here
        self._reported.set()

    def settle(self, timeout: float = 5.0) -> bool:
        """After a collective failed: give the roll call ``timeout`` s to name lost ranks.

        False when it names none (the caller raises its own error). When it does, the job's
        ``on_lost`` ends the process with its line, so this only returns (True) where
        ``on_lost`` returns.
        """
        if not self._verdict.wait(timeout):
            return False
        self._reported.wait()
        return True

    def finish(self) -> None:
        """The run is over for this rank (after its last collective): no loss is reported from now on."""
        self._finished.set()
        self._wake_w.send(b"x")
        for conn in [*self._peers, *([self._hub] if self._hub else [])]:
            try:
                conn.sendall(f"{DONE}\n".encode())
                conn.close()
            except OSError:
                pass


def start_for_job(cfg: TrainConfig, rank: int, world: int, share: Callable[[str], str]) -> Optional[RollCall]:
    """The training job's roll call (None on one node, where the launcher sees every rank itself).

    On a loss each rank stops with :data:`LOST_EXIT_CODE`; the first rank of each node says which ranks
    were lost and at which step (``call.step``, set by the training loop), and where to resume from.
    """
    nodes = nodes_of(cfg, world)
    if nodes.nnodes == 1:
        return None
    call: Optional[RollCall] = None
    first_here = int(os.environ.get("LOCAL_RANK", rank % nodes.per_node)) == 0  # msrun sets no LOCAL_RANK

    def on_lost(lost: dict[int, int]) -> None:
        if not first_here:
            # The launcher stops every rank of this node when the first one exits: leave the first
            # rank here the time to say it.
            time.sleep(SPEAK_FIRST_S)
            os._exit(LOST_EXIT_CODE)
        stop_for_lost_ranks(lost, call.step if call is not None else None, cfg.out_dir,
                            not os.environ.get(LAUNCHER_REPORTS_ENV), last_checkpoint_hint(cfg.checkpoint_dir))

    call = RollCall.start(rank, nodes.node_rank, world, share, nodes.master_addr, on_lost, timeout=cfg.timeout_s)
    return call


@contextlib.contextmanager
def watching(call: Optional[RollCall]) -> Iterator[None]:
    """Run the job's training under its roll call: when it raises (a collective failed), wait for the roll
    call to say whether ranks were lost, and which (it then exits); when it returns, end the roll call."""
    try:
        yield
    except Exception:
        if call is not None:
            call.settle()
        raise
    if call is not None:
        call.finish()


def stop_for_lost_ranks(lost: dict[int, int], step: Optional[int], out_dir: str, say: bool, hint: str) -> None:
    """End this process with :data:`LOST_EXIT_CODE`, leaving the line in ``out_dir`` and printing it if ``say``."""
    when = f"during step {step + 1}" if step is not None else "before the first step"
    whose = "their processes" if len(lost) > 1 else "its process"
    line = (f"lost {describe_ranks(lost)} {when}: {whose} ended or {whose.split()[0]} host stopped answering, "
            f"so the ranks here stopped too{hint}")
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    Path(out_dir, LOST_FILE).write_text(json.dumps({"lost": lost, "step": step, "line": line}))
    if say:
        print(f"fullshard train: {line}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(LOST_EXIT_CODE)


def read_lost_ranks(out_dir: str) -> Optional[dict]:
    """What :func:`stop_for_lost_ranks` left for this node's launcher (None when nothing was lost)."""
    path = Path(out_dir, LOST_FILE)
    return json.loads(path.read_text()) if path.is_file() else None


def clear_lost_ranks(out_dir: str) -> None:
    Path(out_dir, LOST_FILE).unlink(missing_ok=True)
