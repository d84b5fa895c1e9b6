"""No hangs (issue 7): when a rank dies mid-step (``tests/torch/dead_rank_worker.py``), the survivor fails loudly
within the timeout, naming the collective and the module it was serving."""
import os
import subprocess
import sys
import time
from pathlib import Path

from fullshard.train.procs import free_port

ROOT = Path(__file__).resolve().parents[2]

TIMEOUT_S = 20


def test_survivor_exits_nonzero_naming_the_collective_and_module():
    port = free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   FAULT_TIMEOUT_S=str(TIMEOUT_S), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, "-m", "tests.torch.dead_rank_worker"], cwd=ROOT, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    began = time.monotonic()
    try:
        _, survivor_err = procs[0].communicate(timeout=TIMEOUT_S + 60)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    assert procs[1].returncode == 17
    assert procs[0].returncode != 0, "the surviving rank did not fail"
    assert time.monotonic() - began < TIMEOUT_S + 60
    assert "CollectiveError" in survivor_err and "failed on rank 0" in survivor_err, survivor_err[-2000:]
    assert "module '" in survivor_err, survivor_err[-2000:]  # names the module it was serving
