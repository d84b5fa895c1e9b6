"""The theoretical half of a runtime's ``memory_report``, assembled once for both runtimes.

Each runtime counts its own tensors (``fullshard/torch/accounting.py``,
``fullshard/mindspore/accounting.py``) and hands the sizes of its units here;
the ZeRO formulas themselves are :func:`fullshard.plan.strategy.per_rank_theory`.
"""
from __future__ import annotations

from typing import Optional, Sequence

from fullshard.plan.exchange import Collectives, carried_traffic
from fullshard.plan.strategy import Strategy, bytes_sent_per_rank, per_rank_theory


def report_theory(
    strategy: Strategy,
    world: int,
    unit_params: Sequence[int],
    root_params: int,
    *,
    other_params: int = 0,
    param_bytes: int,
    compute_bytes: int,
    reduce_bytes: int,
    adam: bool,
    collectives: Optional[Collectives] = None,
    replicas: int = 1,
    replica_reduce_bytes: Optional[int] = None,
    presence_numel: int = 0,
) -> dict:
    """Memory, traffic and bytes sent per rank for a model of ``unit_params`` (one entry per fully_shard
    unit, the root's own parameters included) plus ``other_params`` fullshard leaves alone, sharded over
    ``world`` ranks and (HSDP) replicated ``replicas`` times.

    Adam keeps two moments per parameter in the parameters' dtype. With ``collectives`` (a backend
    that emulates some of them), ``carried``/``carried_sent`` say what the chosen collectives really
    move for that traffic.
    """
    theory = per_rank_theory(
        strategy, world, sum(unit_params) + other_params, max(unit_params), root_params,
        param_bytes=param_bytes, optim_bytes=2 * param_bytes if adam else 0, compute_bytes=compute_bytes,
        reduce_bytes=reduce_bytes, replicas=replicas, replica_reduce_bytes=replica_reduce_bytes,
        presence_numel=presence_numel,
    )
    figures = {"memory": theory["memory"], "traffic": theory["traffic"], "sent": theory["sent"],
               "replica": theory["replica"]}
    if collectives is not None:
        replica = theory["replica"]
        in_group = {**theory["traffic"], "all_reduce": theory["traffic"]["all_reduce"] - replica["all_reduce"]}
        carried_in_group = carried_traffic(in_group, collectives)
        figures.update(carried=carried_traffic(in_group, collectives, replica["all_reduce"]),
                       carried_sent=bytes_sent_per_rank(carried_in_group, world) + replica["sent"])
    return figures
