"""Run test scenarios in real gloo process groups, many scenarios per spawn.

Spawning processes is slow on small machines, so a test module hands a whole
suite (``module:function`` returning ``{name: callable}``) to
:func:`run_suite`, which starts ``world_size`` fresh interpreters once. Every
scenario runs on every rank, errors are caught per scenario, and the results
come back as ``{name: [per-rank result]}``. Every run carries a wall-clock
timeout and the process group a collective timeout, so a hang fails loudly.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fullshard.train.procs import free_port

ROOT = Path(__file__).resolve().parent.parent
COLLECTIVE_TIMEOUT_S = 60


def run_suite(target: str, world_size: int, timeout: float = 600, env: dict | None = None) -> dict[str, list[dict]]:
    """Run suite ``target`` on ``world_size`` gloo ranks; return per-scenario, per-rank results."""
    port = free_port()
    with tempfile.TemporaryDirectory() as out:
        procs = []
        for rank in range(world_size):
            proc_env = dict(os.environ)
            proc_env.update(env or {})
            proc_env.update(
                RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                PYTHONPATH=f"{ROOT}{os.pathsep}{proc_env.get('PYTHONPATH', '')}",
            )
            log = open(Path(out) / f"log{rank}.txt", "w")
            procs.append((subprocess.Popen(
                [sys.executable, "-m", "tests.harness", target, out], env=proc_env, cwd=ROOT,
                stdout=log, stderr=subprocess.STDOUT,
            ), log))
        deadline = time.monotonic() + timeout
        timed_out = False
        for proc, _ in procs:
            try:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                timed_out = True
                break
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
        logs = "\n".join(f"--- rank {r} ---\n{(Path(out) / f'log{r}.txt').read_text()[-4000:]}" for r in range(world_size))
        if timed_out:
            raise TimeoutError(f"suite {target} on {world_size} ranks did not finish in {timeout}s\n{logs}")
        codes = [proc.returncode for proc, _ in procs]
        if any(codes):
            raise RuntimeError(f"suite {target}: ranks exited with {codes}\n{logs}")
        return read_results(out, world_size)


def read_results(out: str, world_size: int) -> dict[str, list[dict]]:
    """``{scenario: [per-rank result]}`` from the ``rank<r>.json`` files the workers wrote into ``out``."""
    per_rank = [json.loads((Path(out) / f"rank{r}.json").read_text()) for r in range(world_size)]
    names = per_rank[0].keys()
    return {name: [results[name] for results in per_rank] for name in names}


def assert_scenario(results: dict[str, list[dict]], name: str) -> list[dict]:
    """Fail with every rank's traceback unless scenario ``name`` passed on all ranks."""
    assert name in results, f"scenario {name} did not run"
    failures = [f"rank {r}:\n{res['error']}" for r, res in enumerate(results[name]) if not res["ok"]]
    assert not failures, f"scenario {name} failed\n" + "\n".join(failures)
    return [res.get("data") for res in results[name]]


def suite_tests(target: str, world_sizes: tuple[int, ...] = (2,), env: dict | None = None, runner=None,
                timeout: float = 600):
    """A pytest fixture and test for suite ``target``: one spawn per world size, one test per scenario.

    Use at module level: ``results, test_scenario = suite_tests("tests.suite_x:suite")``.
    ``runner`` launches the ranks (default :func:`run_suite`, torch on gloo; MindSpore suites pass
    ``tests.ms_harness.run_ms_suite``).
    """
    import importlib

    import pytest

    module_name, _, func_name = target.partition(":")
    names = list(getattr(importlib.import_module(module_name), func_name)())

    @pytest.fixture(scope="module", params=world_sizes, ids=[f"{n}ranks" for n in world_sizes])
    def results(request):
        return (runner or run_suite)(target, world_size=request.param, timeout=timeout, env=env)

    @pytest.mark.parametrize("name", names)
    def test_scenario(results, name):
        assert_scenario(results, name)

    return results, test_scenario


def _worker(target: str, out: str) -> None:
    import datetime
    import importlib
    import traceback

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    module_name, _, func_name = target.partition(":")
    scenarios = getattr(importlib.import_module(module_name), func_name)()
    results = {}
    for name, scenario in scenarios.items():
        try:
            results[name] = {"ok": True, "data": scenario()}
        except Exception:  # one failing scenario must not hide the others
            results[name] = {"ok": False, "error": traceback.format_exc()}
        dist.barrier()
    Path(out, f"rank{dist.get_rank()}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
