"""Visible accounting: what each rank holds and moves, next to the planning code's figures.

``memory_report(cell, optimizer)`` counts bytes of real tensors (MindSpore
reports no memory statistics on CPU, and RSS does not fall when storage is
freed): the shards and other parameters, optimizer state, the gradients
fullshard owns across backward passes (``main_grad``: the fp32 main grads,
accumulators, HSDP partial sums), and the storage fullshard owns now and at
peak, in all (unsharded parameters and main gradients included) and for
communication alone (``transient_peak``).
Traffic is what every collective fullshard issued since
:func:`fullshard.core.buffers.reset_traffic` really carried, next to the
strategy's theoretical payload and to what the chosen collectives (CPU
emulations included) carry for it.
"""
from __future__ import annotations

from typing import Any, Optional

from mindspore import nn

from fullshard.core.buffers import reset_traffic, traffic_bytes
from fullshard.core.unit import distinct_units
from fullshard.mindspore.collectives import comm_bytes, dtype_bytes
from fullshard.plan.formulas import report_theory
from fullshard.plan.group import Strategy


def _states(cell: nn.Cell) -> list:
    return distinct_units(sub for _, sub in cell.cells_and_names())


def _nbytes(tensors) -> int:
    return sum(t.nbytes for t in tensors)


def memory_report(cell: nn.Cell, optimizer: Optional[nn.Optimizer] = None) -> dict[str, Any]:
    """Bytes this rank holds and moved, with the theoretical figures for the cell's strategy."""
    states = _states(cell)
    groups = [g for s in states for g in s.groups]
    params = list(cell.get_parameters())
    own = {id(p) for p in params}
    names = {p.name for p in params}
    # State per parameter: the optimizer's clones of each parameter (MindSpore names them
    # "<state>.<parameter name>", e.g. moment1.layers.0.fc1.weight); step counters and beta powers are not.
    optim_state = [
        p for p in (optimizer.get_parameters() if optimizer is not None else ())
        if id(p) not in own and p.name.partition(".")[2] in names
    ]
    meter = comm_bytes()
    measured = {
        "params": _nbytes(params),
        # owned gradients kept across backward passes: main_grad, accumulators while sync is off, partial sums
        "main_grad": meter["main_grad_live"],
        "optim": _nbytes(optim_state),
        # unsharded gradients (autograd's) held until their reduction, at most, in the last backward: a whole
        # model's for ZeRO-1, which reduces at the end of backward as DP does; a unit's for the others
        "grads_in_backward": max((s.root.peak_grads_in_backward for s in states if s.root is not None),
                                 default=0),
        "comm_live": meter["live"],  # all owned storage: unsharded parameters, buffers, main gradients
        "comm_peak": meter["peak"],
        "transient_peak": meter["transient_peak"],  # communication buffers only
    }
    report: dict[str, Any] = {"measured": measured, "traffic": traffic_bytes()}
    strategies = {s.strategy for s in states}
    sharded = [g for g in groups if not g.replicated]
    if len(strategies) == 1 and groups:
        group = sharded[0] if sharded else groups[0]
        sample = group.params[0]
        root = next((s for s in states if s.is_root), states[0])
        report["strategy"] = strategies.pop().value
        report["theory"] = report_theory(
            Strategy.parse(report["strategy"]), group.comm.size,
            [sum(p.layout.numel for g in s.groups for p in g.params) for s in states],
            sum(p.layout.numel for g in root.groups for p in g.params),
            param_bytes=dtype_bytes(sample.stored_dtype), compute_bytes=dtype_bytes(sample.compute_dtype),
            reduce_bytes=dtype_bytes(group.wire_dtype(sample)),
            adam=isinstance(optimizer, (nn.Adam, nn.AdamWeightDecay)),
            collectives=group.plan.collectives,
            # HSDP: the reduced chunks are summed across the replicas as they came out of the shard group's
            # reduction, in the wire dtype
            replicas=group.replica.size if group.replica is not None else 1,
        )
    return report


__all__ = ["memory_report", "reset_traffic", "traffic_bytes"]
