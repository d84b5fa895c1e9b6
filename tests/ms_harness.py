"""Run MindSpore test scenarios on ``msrun`` workers, many scenarios per launch.

The launcher for ``tests.harness.suite_tests(..., runner=run_ms_suite)``: the
suites, the per-scenario results and ``assert_scenario`` are the torch
harness's; only starting the ranks differs. ``msrun`` starts ``python`` from
PATH, so the interpreter running the tests goes first on it. Every worker
uses one op thread (two cores serve all of them), every launch runs under a
wall-clock timeout that kills msrun and its workers, and each worker writes
its results after every scenario, so a crash late in a suite still reports
the scenarios before it.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from fullshard.train.procs import free_port
from tests.harness import read_results

ROOT = Path(__file__).resolve().parent.parent
# Lines of MindSpore's own logging that every run prints (and one harmless error at every exit).
_NOISE = re.compile(r"^\[(WARNING|INFO)\]|CPU device is not supported|^\s*$")


def _logs(log_dir: Path, world_size: int, tail: int = 6000) -> str:
    parts = []
    for rank in range(world_size):
        path = log_dir / f"worker_{rank}.log"
        text = path.read_text(errors="replace") if path.exists() else "(no log)"
        kept = "\n".join(line for line in text.splitlines() if not _NOISE.search(line))
        parts.append(f"--- rank {rank} ---\n{kept[-tail:]}")
    return "\n".join(parts)


def run_ms_suite(target: str, world_size: int, timeout: float = 600, env: dict | None = None) -> dict[str, list[dict]]:
    """Run suite ``target`` (``module:function``) on ``world_size`` msrun workers; per-scenario, per-rank results."""
    with tempfile.TemporaryDirectory() as out:
        log_dir = Path(out) / "logs"
        proc_env = dict(os.environ)
        proc_env.update(env or {})
        proc_env.update(
            PATH=f"{Path(sys.executable).parent}{os.pathsep}{proc_env.get('PATH', '')}",
            PYTHONPATH=f"{ROOT}{os.pathsep}{proc_env.get('PYTHONPATH', '')}",
            OMP_NUM_THREADS="1", GLOG_v="3",
        )
        command = [
            "msrun", f"--worker_num={world_size}", f"--local_worker_num={world_size}", f"--master_port={free_port()}",
            f"--log_dir={log_dir}", "--join=True", str(ROOT / "tests" / "ms_harness.py"), target, out,
        ]
        with open(Path(out) / "msrun.txt", "w") as launcher_log:
            proc = subprocess.Popen(command, env=proc_env, cwd=ROOT, stdout=launcher_log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            try:
                code = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # msrun and every worker it started
                proc.wait()
                raise TimeoutError(
                    f"suite {target} on {world_size} msrun workers did not finish in {timeout}s\n"
                    f"{_failures(Path(out), world_size)}{_logs(log_dir, world_size)}"
                ) from None
        if code:
            launcher = (Path(out) / "msrun.txt").read_text(errors="replace")[-2000:]
            raise RuntimeError(
                f"suite {target}: msrun exited with {code}\n{_failures(Path(out), world_size)}"
                f"{_logs(log_dir, world_size)}\n--- msrun ---\n{launcher}"
            )
        return read_results(out, world_size)


def _failures(out: Path, world_size: int) -> str:
    """The tracebacks of scenarios that failed before the launch did (each rank writes as it goes)."""
    found = []
    for rank in range(world_size):
        path = out / f"rank{rank}.json"
        if path.exists():
            for name, result in json.loads(path.read_text()).items():
                if not result["ok"]:
                    found.append(f"--- rank {rank}, scenario {name} ---\n{result['error'][-3000:]}")
    return "\n".join(found) + "\n" if found else ""


def _barrier() -> None:
    import numpy as np
    from mindspore import Tensor, ops

    ops.AllReduce()(Tensor(np.ones(1, np.float32))).asnumpy()


def _worker(target: str, out: str) -> None:
    import importlib
    import traceback

    import mindspore as ms
    from mindspore.communication import get_rank, init

    from fullshard.mindspore.cpu import configure_cpu_worker

    ms.set_context(mode=ms.PYNATIVE_MODE)
    ms.set_device("CPU")
    configure_cpu_worker()  # what fullshard train and the benchmark run with
    init()
    path = Path(out, f"rank{get_rank()}.json")
    module_name, _, func_name = target.partition(":")
    scenarios = getattr(importlib.import_module(module_name), func_name)()
    results = {}
    for name, scenario in scenarios.items():
        try:
            results[name] = {"ok": True, "data": scenario()}
        except Exception:  # one failing scenario must not hide the others
            results[name] = {"ok": False, "error": traceback.format_exc()}
        print(f"scenario {name}: {'ok' if results[name]['ok'] else 'FAILED'}", flush=True)
        path.write_text(json.dumps(results))
        _barrier()


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
