"""The memory and traffic formulas every report takes its figures from, and what a runtime's reduction or an
emulated collective really carries (pure).

``per_rank_theory`` is ZeRO's: what a rank holds and moves per step for a strategy; ``report_theory`` is what
both runtimes' ``memory_report`` put next to what they measured; ``carried_traffic`` is what a backend's
collectives (emulations included) carry for a payload.
"""
from __future__ import annotations

from typing import Optional, Sequence

from fullshard.plan.exchange import Collectives, Exchange, choose_exchange, wire_dtype
from fullshard.plan.group import Strategy


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
    chunk of each reduction carries beyond the gradients (``plan.group.BucketLayout.with_presence``), which
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


DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}


def gradient_wire_bytes(
    all_reduce: bool, backend: str, device_type: str, group_size: int, grad_dtype: str, reduce_dtype: str,
    override: Optional[str] = None,
) -> int:
    """Bytes per gradient element a rank's reduction carries (the traffic formulas' ``reduce_bytes``).

    ``all_reduce``: replicated parameters (``no_shard``), all-reduced in place in the reduce dtype.
    """
    if all_reduce:
        return DTYPE_BYTES[reduce_dtype]
    exchange = choose_exchange(backend, device_type, group_size, override)
    return DTYPE_BYTES[wire_dtype(exchange, grad_dtype, reduce_dtype)]


def carried_traffic(payload: dict[str, float], collectives: Collectives, replica_payload: float = 0.0) -> dict[str, float]:
    """What the collectives of ``collectives`` really carry for the theoretical ``payload``, by the kind
    of collective that carries it (each buffer at its full size, as the traffic meter counts them).

    An emulated reduce-scatter is an all-reduce of the same buffer, and so is an emulated sub-group
    gather; ``replica_payload`` (HSDP: each reduced chunk summed across replicas) is an all-reduce too.
    Passing the result to :func:`fullshard.plan.formulas.bytes_sent_per_rank` gives what the
    emulation sends, next to what the payload needs.
    """
    carried = {"all_gather": 0.0, "reduce_scatter": 0.0, "all_reduce": replica_payload}
    if collectives.gather is Exchange.LOCAL:  # a group of one moves nothing; replicas may still sum
        return carried
    carried["all_reduce"] += payload.get("all_reduce", 0.0)
    gather, reduce = payload.get("all_gather", 0.0), payload.get("reduce_scatter", 0.0)
    carried["all_reduce" if collectives.gather is Exchange.ZERO_FILLED_ALL_REDUCE else "all_gather"] += gather
    carried["all_reduce" if collectives.reduce is Exchange.ALL_REDUCE_CHUNK else "reduce_scatter"] += reduce
    return carried


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
