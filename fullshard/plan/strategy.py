"""Sharding strategies by name, as lifecycle flags, with their memory and traffic (pure).

The names are those of Megatron-FSDP's ``data_parallel_sharding_strategy``
(and of the seed's configuration). Each one is a set of flags on the same
runtime:

=====================  ==============  =================  ==================  ===================
strategy               stored params   reshard after fwd  reshard after bwd   gradient reduction
=====================  ==============  =================  ==================  ===================
no_shard (DDP)         replicated      no (never gathered) no                  all-reduce, per group
optim (ZeRO-1)         sharded         no                 no (kept, refreshed) reduce-scatter, once at end of backward
optim_grads (ZeRO-2)   sharded         no                 no (kept, refreshed) reduce-scatter, per group
optim_grads_params     sharded         yes (not root)     yes                 reduce-scatter, per group
=====================  ==============  =================  ==================  ===================

"Kept, refreshed": the unsharded parameters stay allocated across steps and
are all-gathered again (into the same storage) in the first forward after a
synced backward, since the optimizer changed the shards in between.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional


class Strategy(enum.Enum):
    NO_SHARD = "no_shard"
    OPTIM = "optim"
    OPTIM_GRADS = "optim_grads"
    OPTIM_GRADS_PARAMS = "optim_grads_params"

    @classmethod
    def parse(cls, name: "str | Strategy") -> "Strategy":
        if isinstance(name, Strategy):
            return name
        try:
            return cls(name)
        except ValueError:
            names = ", ".join(repr(s.value) for s in cls)
            raise ValueError(f"unknown strategy {name!r}; choose one of {names}") from None


class AfterBackward(enum.Enum):
    """What a unit does with its gathered parameters once its backward is done."""

    RESHARD = "reshard"  # free them (ZeRO-3)
    # Keep the storage but show the shards, and gather into it again before the next use: after a
    # synced backward the optimizer steps (ZeRO-1/2; without sync they stay gathered, accumulating).
    KEEP_STORAGE = "keep storage"
    # Keep them gathered for the next forward, synced or not (FSDP2's set_reshard_after_backward(False),
    # for accumulation): the caller promises no write below autograd before then; a write through it
    # (an optimizer step) still moves a version counter and gathers again.
    KEEP_GATHERED = "keep gathered"


@dataclass(frozen=True)
class Lifecycle:
    reshard_after_forward: bool
    reshard_after_backward: bool
    all_reduce: bool  # True: all-reduce full gradients (replicated); False: reduce-scatter
    reduce_at_end_of_backward: bool  # True: one reduction pass after the whole backward (ZeRO-1)


def lifecycle(strategy: Strategy, is_root: bool, reshard_after_forward: Optional[bool] = None) -> Lifecycle:
    """The flags of ``strategy``; an explicit ``reshard_after_forward`` (FSDP2's argument) wins."""
    if strategy is Strategy.NO_SHARD:
        return Lifecycle(False, False, True, False)
    if strategy is Strategy.OPTIM_GRADS_PARAMS:
        after_forward = (not is_root) if reshard_after_forward is None else reshard_after_forward
        return Lifecycle(after_forward, True, False, False)
    after_forward = False if reshard_after_forward is None else reshard_after_forward
    return Lifecycle(after_forward, False, False, strategy is Strategy.OPTIM)


def peak_state_bytes(
    strategy: Strategy,
    world: int,
    num_params: int,
    largest_unit_params: int,
    param_bytes: int = 4,
    grad_bytes: int = 4,
    optim_bytes: int = 8,
    compute_bytes: Optional[int] = None,
) -> dict[str, float]:
    """Per-rank bytes for parameters, gradients, optimizer state and the unsharded working copies.

    params + grads + optim follow ZeRO's formulas: for fp32 Adam (4, 4, 8
    bytes) 16 per parameter replicated, 8 + 8/N for ZeRO-1, 4 + 12/N for
    ZeRO-2 and 16/N for ZeRO-3. ``unsharded`` is the largest unit in flight
    (ZeRO-3) or the whole model kept between steps (ZeRO-1/2).
    """
    n = world
    compute = param_bytes if compute_bytes is None else compute_bytes
    sharded = strategy is not Strategy.NO_SHARD
    params = num_params * param_bytes / (n if sharded else 1)
    sharded_grads = strategy in (Strategy.OPTIM_GRADS, Strategy.OPTIM_GRADS_PARAMS)
    grads = num_params * grad_bytes / (n if sharded_grads else 1)
    optim = num_params * optim_bytes / (n if sharded else 1)
    if strategy is Strategy.OPTIM_GRADS_PARAMS:
        # one unit's unsharded parameters and gradients in flight
        unit = largest_unit_params * (compute + grad_bytes)
    elif sharded:
        # the whole model's unsharded parameters are kept (ZeRO-1/2)
        unit = num_params * compute
    else:
        unit = 0.0
    return {"params": params, "grads": grads, "optim": optim, "unsharded": unit, "total": params + grads + optim + unit}


def traffic_bytes_per_step(
    strategy: Strategy,
    world: int,
    num_params: int,
    root_params: int = 0,
    gather_bytes: int = 4,
    reduce_bytes: int = 4,
) -> dict[str, float]:
    """Bytes of collective payload per rank per step (the size of each collective's full buffer).

    ZeRO-3 gathers every non-root unit twice (forward and backward) and the
    root once (it is not resharded after forward); ZeRO-1/2 gather once;
    all strategies but ``no_shard`` reduce-scatter once and ``no_shard``
    all-reduces once. With one rank nothing moves.
    """
    if world == 1:
        return {"all_gather": 0.0, "reduce_scatter": 0.0, "all_reduce": 0.0}
    if strategy is Strategy.NO_SHARD:
        return {"all_gather": 0.0, "reduce_scatter": 0.0, "all_reduce": float(num_params * reduce_bytes)}
    gathers = num_params + (num_params - root_params if strategy is Strategy.OPTIM_GRADS_PARAMS else 0)
    return {
        "all_gather": float(gathers * gather_bytes),
        "reduce_scatter": float(num_params * reduce_bytes),
        "all_reduce": 0.0,
    }


def bytes_sent_per_rank(payload: dict[str, float], world: int) -> float:
    """The fewest bytes a rank must send to carry out collectives of the given payloads.

    A bandwidth-optimal all-gather or reduce-scatter sends (N-1)/N of its full
    buffer from each rank (ring, or the pairwise exchange); an all-reduce is a
    reduce-scatter followed by an all-gather, 2(N-1)/N.
    """
    share = (world - 1) / world
    return share * (payload.get("all_gather", 0.0) + payload.get("reduce_scatter", 0.0)) + 2 * share * payload.get(
        "all_reduce", 0.0
    )


def per_rank_theory(
    strategy: Strategy,
    world: int,
    num_params: int,
    largest_unit: int,
    root_params: int = 0,
    *,
    param_bytes: int = 4,
    optim_bytes: int = 8,
    compute_bytes: Optional[int] = None,
    reduce_bytes: int = 4,
    micro_batches: int = 1,
    replicas: int = 1,
    replica_reduce_bytes: Optional[int] = None,
    presence_numel: int = 0,
) -> dict[str, object]:
    """What a rank holds and moves per step, the one place every report takes the ZeRO figures from.

    ``world`` is the number of ranks a parameter is sharded over; HSDP's ``replicas`` copies of that
    group hold the same shards. ``memory``: :func:`peak_state_bytes` (gradients in the parameters'
    dtype); ``traffic``: :func:`traffic_bytes_per_step`, where ZeRO-3 gathers again for every
    micro-batch while gradients are reduced once per step, plus (HSDP) the all-reduce of each reduced
    gradient shard across the replicas (``replica``: its payload and the bytes it sends; it travels in
    ``replica_reduce_bytes``, by default ``reduce_bytes``); ``sent``: :func:`bytes_sent_per_rank` of
    the shard group's traffic over ``world`` ranks and of the replicas' all-reduce over ``replicas``.
    ``largest_unit`` counts the root's own parameters as a unit too. ``presence_numel``: the counts a rank's
    chunk of each reduction carries beyond the gradients (``plan.layout.BucketLayout.with_presence``), which
    travel with the gradients, in their dtype.
    """
    compute = param_bytes if compute_bytes is None else compute_bytes
    memory = peak_state_bytes(
        strategy, world, num_params, largest_unit, param_bytes, param_bytes, optim_bytes, compute
    )
    traffic = traffic_bytes_per_step(strategy, world, num_params, root_params, compute, reduce_bytes)
    if strategy is Strategy.OPTIM_GRADS_PARAMS:
        traffic["all_gather"] *= micro_batches
    if world > 1:  # each rank's chunk of a reduction, times the ranks: a reduce-scatter's (or all-reduce's) buffer
        kind = "all_reduce" if strategy is Strategy.NO_SHARD else "reduce_scatter"
        traffic[kind] += float(presence_numel * (1 if strategy is Strategy.NO_SHARD else world) * reduce_bytes)
    sent = bytes_sent_per_rank(traffic, world)
    replica = replica_all_reduce(strategy, world, num_params + presence_numel * world, replicas,
                                 reduce_bytes if replica_reduce_bytes is None else replica_reduce_bytes)
    traffic["all_reduce"] += replica["all_reduce"]
    return {"memory": memory, "traffic": traffic, "sent": sent + replica["sent"], "replica": replica}


def replica_all_reduce(strategy: Strategy, world: int, num_params: int, replicas: int,
                       reduce_bytes: int) -> dict[str, float]:
    """HSDP: each rank all-reduces its reduced gradient shard (``num_params / world`` elements) across the
    ``replicas`` groups once per step; its payload and the bytes a rank sends for it. Nothing without
    replicas, and for ``no_shard``, whose all-reduce already spans every rank."""
    if replicas == 1 or strategy is Strategy.NO_SHARD:
        return {"all_reduce": 0.0, "sent": 0.0}
    payload = float(num_params * reduce_bytes / world)
    return {"all_reduce": payload, "sent": bytes_sent_per_rank({"all_reduce": payload}, replicas)}
