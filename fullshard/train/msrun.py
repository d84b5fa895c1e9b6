"""Start MindSpore workers with ``msrun`` and watch them: a failed worker stops the job at once, named by rank.

Framework-free (it only starts processes). ``msrun`` runs a script, so the
module to run goes through a two-line stub written into the run directory;
``python`` is looked up on PATH by msrun, so this interpreter's directory goes
first. Each worker calls :func:`register_worker` after ``init()``: it leaves
its pid (and rank) in the run directory, which is how a failure msrun reports
by pid is turned into the rank that failed. msrun would wait for its
scheduler's heartbeat timeout (about 30 s) before stopping the others; the
watcher stops them all as soon as msrun reports the first failed worker.

On several nodes each node runs :func:`launch` with its ``node_rank``;
msrun numbers the ranks ``node_rank * nproc + i`` and node 0 (at
``master_addr``) runs the scheduler.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Optional

from fullshard.train.procs import descendants, free_port

RUN_DIR_ENV = "FULLSHARD_MSRUN_DIR"
NODE_RANK_ENV = "FULLSHARD_NODE_RANK"
_FAILED = re.compile(r"Worker process (\d+) exit with exception\. Error code: (-?\d+)")
# MindSpore's own log lines, and one harmless error every CPU worker prints at exit.
NOISE = re.compile(r"^\[(WARNING|INFO)\]|CPU device is not supported|^\s*$")
_PACKAGE_ROOT = Path(__file__).resolve().parents[2]


class WorkerFailed(Exception):
    """A worker failed (``rank`` is None when it died before registering); ``log`` is its log's tail."""

    def __init__(self, message: str, rank: Optional[int] = None, exit_code: Optional[int] = None, log: str = "") -> None:
        super().__init__(message)
        self.rank, self.exit_code, self.log = rank, exit_code, log


class Interrupted(Exception):
    """The launcher got SIGINT or SIGTERM; the workers were stopped."""


def _interrupt(signum, _frame) -> None:
    raise Interrupted(signal.Signals(signum).name)


def register_worker(rank: int) -> None:
    """Called by each worker once it knows its rank (no-op outside :func:`launch`)."""
    run_dir = os.environ.get(RUN_DIR_ENV)
    if run_dir:
        Path(run_dir, f"rank_{rank}.pid").write_text(str(os.getpid()))


def run_dir() -> Optional[Path]:
    """The launch's run directory, in a worker (None outside :func:`launch`)."""
    value = os.environ.get(RUN_DIR_ENV)
    return Path(value) if value else None


def worker_log(log_dir: Path, rank: int, tail: int = 4000) -> str:
    path = Path(log_dir) / f"worker_{rank}.log"
    text = path.read_text(errors="replace") if path.exists() else "(no log)"
    return "\n".join(line for line in text.splitlines() if not NOISE.search(line))[-tail:]


def _ranks_by_pid(directory: Path) -> dict[int, int]:
    ranks = {}
    for path in directory.glob("rank_*.pid"):
        try:
            ranks[int(path.read_text())] = int(path.stem.split("_")[1])
        except ValueError:
            continue
    return ranks


def kill_launch(proc: subprocess.Popen) -> None:
    """Kill msrun, its scheduler and every worker: the workers run in sessions of their own (msrun
    starts them with setsid), out of reach of msrun's process group, so they are found by parent."""
    below = descendants(proc.pid)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for pid in below:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def _stub(module: str) -> str:
    """The script msrun runs: it runs ``module``; on a node other than node 0 a scheduler steps aside.

    msrun starts a scheduler on every node that finds --master_addr among its own addresses: on
    real machines only node 0, on one host every node. Only node 0's may serve; another would
    fail to bind the port and fail its msrun at the end, after training succeeded.
    """
    return (f"import os, runpy, sys\n"
            f"if os.environ.get('MS_ROLE') == 'MS_SCHED' and os.environ.get({NODE_RANK_ENV!r}, '0') != '0':\n"
            f"    sys.exit(0)\n"
            f"sys.argv[0] = {module!r}\nrunpy.run_module({module!r}, run_name='__main__', alter_sys=True)\n")


def launch(module: str, args: list[str], nproc: int, directory: Path, *, timeout: Optional[float] = None,
           env: Optional[dict] = None, follow: Optional[Callable[[str], None]] = None,
           follow_file: str = "progress.log", nnodes: int = 1, node_rank: int = 0, master_addr: str = "127.0.0.1",
           master_port: Optional[int] = None) -> None:
    """Run ``python -m module *args`` on ``nproc`` msrun workers (this node's); return when all finished.

    ``directory`` (created) holds the stub, msrun's output, the workers' logs
    (``logs/worker_<r>.log``) and whatever the workers write there
    (:func:`run_dir`). Lines appended to ``directory/follow_file`` are passed
    to ``follow`` as they come. With ``nnodes`` > 1, this is node ``node_rank``
    of a run whose node 0 is at ``master_addr:master_port``. Raises
    :class:`WorkerFailed` naming the first rank that failed, or ``TimeoutError``.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    stub = directory / "msrun_entry.py"
    stub.write_text(_stub(module))
    log_dir = directory / "logs"
    proc_env = dict(os.environ)
    proc_env.update(env or {})
    proc_env.update(
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{proc_env.get('PATH', '')}",
        PYTHONPATH=f"{_PACKAGE_ROOT}{os.pathsep}{proc_env.get('PYTHONPATH', '')}",
        GLOG_v=proc_env.get("GLOG_v", "3"), OMP_NUM_THREADS=proc_env.get("OMP_NUM_THREADS", "1"),
        **{RUN_DIR_ENV: str(directory), NODE_RANK_ENV: str(node_rank)},
    )
    command = ["msrun", f"--worker_num={nproc * nnodes}", f"--local_worker_num={nproc}",
               f"--master_port={master_port or free_port()}", f"--log_dir={log_dir}", "--join=True"]
    if nnodes > 1:
        command += [f"--master_addr={master_addr}", f"--node_rank={node_rank}"]
    command += [str(stub), *args]
    launcher_log = directory / "msrun.txt"
    followed = directory / follow_file
    # msrun runs in a session of its own (so that it and its workers can be stopped together): a signal
    # to this process must stop them too.
    handlers = {}
    if threading.current_thread() is threading.main_thread():
        handlers = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        _run(command, proc_env, launcher_log, followed, follow, log_dir, directory, nproc, timeout)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def _run(command, proc_env, launcher_log: Path, followed: Path, follow, log_dir: Path, directory: Path, nproc: int,
         timeout: Optional[float]) -> None:
    position = 0
    deadline = None if timeout is None else time.monotonic() + timeout
    with open(launcher_log, "w") as out:
        try:
            proc = subprocess.Popen(command, env=proc_env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        except FileNotFoundError:
            raise WorkerFailed("msrun was not found: install MindSpore (pip install 'fullshard[mindspore]')") from None
        try:
            while True:
                code = proc.poll()
                if follow is not None and followed.exists():
                    with open(followed, "rb") as handle:
                        handle.seek(position)
                        chunk = handle.read()
                    complete = chunk[: chunk.rfind(b"\n") + 1]
                    position += len(complete)
                    for line in complete.decode(errors="replace").splitlines():
                        follow(line)
                failure = _FAILED.search(launcher_log.read_text(errors="replace"))
                if failure is not None:
                    kill_launch(proc)
                    pid, exit_code = int(failure.group(1)), int(failure.group(2))
                    rank = _ranks_by_pid(directory).get(pid)
                    who = f"rank {rank}" if rank is not None else f"a worker (pid {pid}, before it knew its rank)"
                    log = worker_log(log_dir, rank) if rank is not None else ""
                    raise WorkerFailed(f"{who} failed first (exit code {exit_code}); the other workers were stopped",
                                       rank, exit_code, log)
                if code is not None:
                    if code:
                        tail = launcher_log.read_text(errors="replace")[-2000:]
                        raise WorkerFailed(f"msrun exited with code {code}:\n{tail}", None, code)
                    return
                if deadline is not None and time.monotonic() > deadline:
                    kill_launch(proc)
                    raise TimeoutError(f"{nproc} msrun workers did not finish in {timeout:g} s")
                time.sleep(0.2)
        except BaseException:
            if proc.poll() is None:
                kill_launch(proc)
            raise
