"""Visible accounting: what each rank holds and moves, next to the planning code's figures.

``memory_report(model, optimizer)`` counts bytes of real tensors (not RSS):
sharded parameters, gradients (sharded ``.grad`` plus unsharded gradients
still held, e.g. while accumulating without sync), optimizer state, the
gradients fullshard owns across backward passes (``main_grad``: fp32
accumulators, HSDP partial sums), and the storage fullshard owns in all and
for communication alone (``comm_live``/``comm_peak`` include the unsharded
parameters kept between steps and the main gradients; ``transient_peak`` is
the communication buffers only). Traffic is the payload of every collective fullshard
issued since :func:`reset_traffic`.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fullshard.core.unit import distinct_units
from fullshard.plan.formulas import report_theory
from fullshard.core.buffers import reset_traffic, traffic_bytes, traffic_by_mesh
from fullshard.torch.collectives import comm_bytes


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _nbytes(tensors) -> int:
    seen, total = set(), 0
    for tensor in tensors:
        local = _local(tensor)
        key = (local.untyped_storage().data_ptr(), local.storage_offset(), local.numel())
        if key in seen:
            continue
        seen.add(key)
        total += local.numel() * local.element_size()
    return total


def _states(model: nn.Module) -> list:
    return distinct_units(model.modules())


def presence_numel(model: nn.Module) -> int:
    """The counts of which parameters a rank had gradients for that a reduction of ``model``'s units carries
    beyond the gradients, per rank's chunk (``plan.group.plan_presence``)."""
    return sum(g.plan.presence_numel for s in _states(model) for g in s.groups)


def mesh_params(model: nn.Module) -> dict[str, dict]:
    """The meshes ``model``'s groups shard over, by the key their collectives are counted under
    (:func:`traffic_by_mesh`): each one's shard ranks, replicas and sharded parameters (the modules' own)."""
    meshes: dict[str, dict] = {}
    for state in _states(model):
        for group in state.groups:
            mesh = meshes.setdefault(group.mesh_key, {"shards": group.world, "replicas": group.replicas, "params": []})
            mesh["params"] += [p.sharded for p in group.params]
    return meshes


def memory_report(model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None) -> dict:
    """Bytes this rank holds and moved, with the theoretical figures for the model's strategy."""
    states = list(_states(model))
    managed = [p for s in states for g in s.groups for p in g.params]
    # The sharded parameters, whatever the modules show right now (after a forward that did not
    # reshard they show the unsharded ones, as FSDP2's do), and the parameters fullshard leaves alone.
    shown = {id(p.unsharded) for p in managed if p.unsharded is not None}
    params = [p.sharded for p in managed] + [
        p for p in model.parameters() if id(p) not in shown and not getattr(p, "_fullshard_managed", False)
    ]
    unsharded_grads = [
        p.unsharded.grad for p in managed if p.unsharded is not None and p.unsharded.grad is not None
    ]
    meter = comm_bytes()
    measured = {
        "params": _nbytes(params),
        "grads": _nbytes([p.grad for p in params if p.grad is not None] + unsharded_grads),
        "optim": _nbytes(
            v for s in (optimizer.state.values() if optimizer else ()) for v in s.values()
            if torch.is_tensor(v) and v.dim() > 0  # Adam's scalar step counters are not state per parameter
        ),
        "comm_live": meter["live"],  # all owned storage: unsharded parameters and main gradients included
        "comm_peak": meter["peak"],
        "transient_peak": meter["transient_peak"],  # communication buffers only
        # owned gradients kept across backward passes: accumulators while sync is off, HSDP partial sums
        "main_grad": meter["main_grad_live"],
    }
    report = {"measured": measured, "traffic": traffic_bytes()}
    strategies = {s.strategy for s in states}
    if len(strategies) == 1 and states and states[0].group is not None:
        strategy = strategies.pop()
        root = next((s for s in states if s.is_root), states[0])
        group = states[0].group
        sample = group.params[0]
        # what gradients travel in: the reduce dtype, or narrower on the pairwise exchange
        wire = getattr(torch, group.plan.wire_dtype(0, group.replicated, group.accumulated_without_sync))
        report["strategy"] = strategy.value
        theory = report_theory(
            strategy, group.world, [sum(p.layout.numel for p in s.group.params) for s in states if s.group is not None],
            sum(p.layout.numel for p in root.group.params) if root.group is not None else 0,
            # tensor-parallel parameters count their local part: what data parallelism shards
            other_params=sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in params[len(managed):]),
            param_bytes=_element_size(sample.stored_dtype), compute_bytes=_element_size(sample.compute_dtype),
            reduce_bytes=_element_size(wire), adam=isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)),
            # HSDP: the reduced shards are summed across the replicas in the reduce dtype
            replicas=group.replicas, replica_reduce_bytes=_element_size(group.reduce_dtype(0)),
            # the counts of which members a rank had gradients for, in every fused bucket a reduction carries
            presence_numel=presence_numel(model),
        )
        report["theory"] = {"memory": theory["memory"], "traffic": theory["traffic"]}
    return report


__all__ = ["memory_report", "mesh_params", "reset_traffic", "traffic_by_mesh", "traffic_bytes"]
