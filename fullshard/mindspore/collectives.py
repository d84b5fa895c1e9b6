"""All-gather, reduce-scatter and all-reduce over a MindSpore group, the way ``fullshard.plan.exchange`` chose.

MindSpore's collectives are out of place: each returns new storage and only
reads its input, so the caller may pass storage it merely borrows. On CPU
(mccl) every call blocks until done; nothing here is asynchronous. Each call
counts the bytes it really carried in ``fullshard.core.traffic``, under the
collective that carried them: an emulated reduce-scatter or sub-group gather
counts as the all-reduce it is.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from mindspore import Tensor, mint, ops

from fullshard.core.agreement import Ranks, alone
from fullshard.core.traffic import count, timed
from fullshard.mindspore import buffers
from fullshard.plan import Exchange


@dataclass(frozen=True)
class Comm:
    """One group as the collectives see it: its name (None: this rank alone), size and this rank's index."""

    group: Optional[str]
    size: int
    rank: int


_PRIMITIVES: dict = {}


def _primitive(kind: str, group: str):
    key = (kind, group)
    if key not in _PRIMITIVES:
        if kind == "all_gather":
            _PRIMITIVES[key] = ops.AllGather(group=group)
        elif kind == "all_reduce":
            _PRIMITIVES[key] = ops.AllReduce(op=ops.ReduceOp.SUM, group=group)
        else:
            _PRIMITIVES[key] = ops.ReduceScatter(op=ops.ReduceOp.SUM, group=group)
    return _PRIMITIVES[key]


def all_gather(exchange: Exchange, chunk: Tensor, comm: Comm, label: str) -> Tensor:
    """Every rank's ``chunk`` (the same shape everywhere) concatenated along dim 0, rank-major, in new storage."""
    if exchange is Exchange.LOCAL:
        return chunk.copy()
    if exchange is Exchange.COLLECTIVE:
        with timed("all_gather"):
            out = _primitive("all_gather", comm.group)(chunk)
        count("all_gather", out.nbytes)
        return out
    if exchange is not Exchange.ZERO_FILLED_ALL_REDUCE:
        raise ValueError(f"all-gather of {label}: the MindSpore runtime has no {exchange.value} exchange")
    # Zero everywhere but this rank's chunk; the sum over the group is then every rank's chunk in place.
    rows, rest = chunk.shape[0], tuple(chunk.shape[1:])
    before, after = comm.rank * rows, (comm.size - comm.rank - 1) * rows
    parts = [ops.zeros((before,) + rest, chunk.dtype), chunk, ops.zeros((after,) + rest, chunk.dtype)]
    filled = buffers.adopt(mint.cat([p for p in parts if p.shape[0]]), f"zero-filled all-gather buffer of {label}",
                           (chunk,))
    try:
        with timed("all_reduce"):
            out = _primitive("all_reduce", comm.group)(filled.tensor)
        count("all_reduce", out.nbytes)
    finally:
        filled.reclaim()
    return out


def reduce_scatter(exchange: Exchange, flat: Tensor, comm: Comm) -> tuple[Tensor, int]:
    """The sum over the group of every rank's ``flat`` (rank-major), and where this rank's chunk starts in it.

    The backend's reduce-scatter returns only the chunk (offset 0); the
    emulation returns the whole sum (``Exchange.ALL_REDUCE_CHUNK``), the
    chunk at ``rank * len(flat) / size``.
    """
    if exchange is Exchange.LOCAL:
        return flat.copy(), 0
    if exchange is Exchange.COLLECTIVE:
        with timed("reduce_scatter"):
            out = _primitive("reduce_scatter", comm.group)(flat)
        count("reduce_scatter", flat.nbytes)
        return out, 0
    with timed("all_reduce"):
        out = _primitive("all_reduce", comm.group)(flat)
    count("all_reduce", out.nbytes)
    return out, comm.rank * (flat.shape[0] // comm.size)


def all_reduce(flat: Tensor, comm: Comm) -> Tensor:
    """The sum of ``flat`` over the group, in new storage (a copy for a group of one)."""
    if comm.size == 1:
        return flat.copy()
    with timed("all_reduce"):
        out = _primitive("all_reduce", comm.group)(flat)
    count("all_reduce", out.nbytes)
    return out


def sum_floats(values: list[float], comm: Comm) -> list[float]:
    """``values`` summed over the group as float32 (a control message, not model bytes: not counted as traffic)."""
    import numpy as np

    from fullshard.mindspore.autograd import no_grad

    with no_grad():
        return _primitive("all_reduce", comm.group)(Tensor(np.asarray(values, np.float32))).asnumpy().tolist()


def world_ranks() -> Ranks:
    """Every rank, summing float32 on the world group (every mesh spans it, and no setting can change it), or
    this process alone before ``init()``."""
    from mindspore.communication import GlobalComm, get_group_size, get_rank

    if not GlobalComm.INITED:
        return alone()
    world = Comm(GlobalComm.WORLD_COMM_GROUP, get_group_size(), get_rank())
    return Ranks(lambda values: sum_floats(values, world), world.rank, world.size)

