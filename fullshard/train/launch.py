"""Start the main job's ranks on this node: through PyTorch's elastic launcher (the machinery behind
``torchrun``), in this process when ``torchrun`` started it, or as ``msrun`` workers (MindSpore); a failed or
interrupted worker is one ``WorkerFailed`` naming the rank that failed first."""
from __future__ import annotations

import json
import os
import sys
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import Optional

from fullshard.train.config import last_checkpoint_hint
from fullshard.train.nodes import Nodes
from fullshard.train.procs import free_port


class WorkerFailed(Exception):
    """A worker process failed: reported with the rank that failed first, exit status 1."""


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _rendezvous(nodes: Nodes) -> dict:
    """How this node's agent meets the others' (LaunchConfig's rendezvous fields).

    One node: c10d on a free loopback port. Several: the static rendezvous, the only one that keeps
    --node-rank (c10d numbers nodes in the order they arrive); node 0 holds its store at
    --master-addr:--master-port.
    """
    if nodes.nnodes == 1:
        return dict(rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{free_port()}",
                    run_id=f"fullshard-{uuid.uuid4().hex[:8]}")
    return dict(rdzv_backend="static", rdzv_endpoint=f"{nodes.master_addr}:{nodes.master_port}",
                rdzv_configs={"rank": nodes.node_rank}, run_id=f"fullshard-{nodes.master_port}")


def _launch_torch(cfg, nodes: Nodes) -> list[dict]:
    """Start this node's workers with torch's elastic launcher; return every rank's result."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from fullshard.train.rollcall import LAUNCHER_REPORTS_ENV, clear_lost_ranks
    from fullshard.train.worker import worker_entry

    config = LaunchConfig(min_nodes=nodes.nnodes, max_nodes=nodes.nnodes, nproc_per_node=nodes.per_node,
                          max_restarts=0, monitor_interval=0.5, start_method="spawn", **_rendezvous(nodes))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ[LAUNCHER_REPORTS_ENV] = "1"  # a lost node is said once, below, not by every worker too
    clear_lost_ranks(cfg.out_dir)
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    try:
        returned = elastic_launch(config, worker_entry)(json.dumps(asdict(cfg)))
    except (SignalException, KeyboardInterrupt) as error:
        hint = last_checkpoint_hint(cfg.checkpoint_dir)
        raise WorkerFailed(f"interrupted ({error or 'keyboard interrupt'}){hint}") from None
    except ChildFailedError as error:
        rank, failure = error.get_first_failure()
        _raise_if_ranks_were_lost(cfg, failure.exitcode)
        raise WorkerFailed(
            f"rank {rank} failed first (exit code {failure.exitcode}); the other ranks stopped with it. "
            "Its traceback is printed above."
        ) from None
    return returned[min(returned)]  # keyed by global rank: on node k the first is k * nproc


def _raise_if_ranks_were_lost(cfg, exit_code: Optional[int]) -> None:
    """A worker that stopped because other nodes' ranks were lost left the line to say (rollcall.py)."""
    from fullshard.train.rollcall import LOST_EXIT_CODE, read_lost_ranks

    lost = read_lost_ranks(cfg.out_dir) if exit_code == LOST_EXIT_CODE else None
    if lost is not None:
        raise WorkerFailed(lost["line"])


def _launch_mindspore(cfg, nodes: Nodes) -> list[dict]:
    from fullshard.train import msrun
    from fullshard.train.rollcall import clear_lost_ranks
    from fullshard.train.worker_mindspore import launch

    clear_lost_ranks(cfg.out_dir)
    try:
        return launch(cfg, nodes, Path(cfg.out_dir) / "msrun")
    except msrun.Interrupted as error:
        raise WorkerFailed(f"interrupted ({error}){last_checkpoint_hint(cfg.checkpoint_dir)}") from None
    except msrun.WorkerFailed as error:
        _raise_if_ranks_were_lost(cfg, error.exit_code)
        if error.log:
            print(f"--- rank {error.rank}'s log (the rest is in {Path(cfg.out_dir) / 'msrun' / 'logs'}) ---\n"
                  f"{error.log}", file=sys.stderr)
        raise WorkerFailed(f"{error}{last_checkpoint_hint(cfg.checkpoint_dir)}") from None


def _announce(cfg, nodes: Nodes) -> None:
    """The first line: what starts here (on several nodes, which part of the run this node is)."""
    what = "msrun workers (mindspore)" if cfg.framework == "mindspore" else "processes"
    where = ""
    if nodes.nnodes > 1:
        ranks = nodes.ranks_on(nodes.node_rank)
        where = (f" on node {nodes.node_rank} of {nodes.nnodes} (ranks {ranks[0]}-{ranks[-1]} of {nodes.world}, "
                 f"node 0 at {nodes.master_addr}:{nodes.master_port})")
    print(f"fullshard train: {nodes.per_node} {what}{where}, model {cfg.model}, strategy {cfg.strategy}, "
          f"{cfg.mixed_precision}, {cfg.steps} steps -> {cfg.out_dir}", flush=True)


def run_workers(cfg, nodes: Nodes) -> Optional[list[dict]]:
    """Every rank's result on the node that reports (rank 0's), this node's ranks' elsewhere; None: nothing to say."""
    if cfg.framework == "torch" and under_torchrun():  # this process is one rank
        from fullshard.train.worker import worker_entry

        results = worker_entry(json.dumps(asdict(cfg)))
        first_here = int(os.environ.get("LOCAL_RANK", 0)) == 0
        if int(os.environ["RANK"]) != 0 and not (first_here and nodes.nnodes > 1):
            return None
        return results
    _announce(cfg, nodes)
    return _launch_mindspore(cfg, nodes) if cfg.framework == "mindspore" else _launch_torch(cfg, nodes)
