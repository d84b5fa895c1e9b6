"""Gradient clipping by the global norm over every rank's shards."""
from __future__ import annotations

from typing import Sequence

import mindspore as ms
from mindspore import Tensor, ops

from fullshard.mindspore.collectives import all_reduce
from fullshard.mindspore.autograd import no_grad
from fullshard.mindspore.param import sharded_param_of


def clip_grad_norm(params: Sequence[ms.Parameter], grads: Sequence[Tensor], max_norm: float,
                   eps: float = 1e-6) -> tuple[tuple[Tensor, ...], Tensor]:
    """Scale ``grads`` (those of ``params``, as ``value_and_grad`` returns them) so that their global
    L2 norm is at most ``max_norm``; returns ``(clipped_grads, total_norm)``.

    The norm is that of the whole model's gradient: the squares of sharded gradients are summed
    across their shard group (each element lives on one rank of it; HSDP replicas hold the same
    shards and are not counted again), and replicated or unmanaged parameters count once, from
    this rank's copy. The scale is ``max_norm / (total_norm + eps)`` where that is below 1, as in
    ``torch.nn.utils.clip_grad_norm_``. A collective: call it on every rank.
    """
    params, grads = list(params), list(grads)
    if len(params) != len(grads):
        raise ValueError(f"clip_grad_norm: {len(params)} params but {len(grads)} grads; pass both in the same order")
    with no_grad():
        local = ops.zeros((1,), ms.float32)
        per_group: dict = {}
        for param, grad in zip(params, grads):
            square = (grad.astype(ms.float32) ** 2).sum().reshape(1)
            sharded = sharded_param_of(param)
            if sharded is None or sharded.replicated or sharded.group.comm.size == 1:
                local = local + square
            else:
                comm = sharded.group.comm
                per_group[comm.group] = (comm, per_group.get(comm.group, (comm, 0.0))[1] + square)
        total = local
        for key in sorted(per_group):  # the same order on every rank
            comm, partial = per_group[key]
            total = total + all_reduce(partial, comm)
        total_norm = ops.sqrt(total).reshape(())
        scale = float(max_norm) / (float(total_norm.asnumpy()) + eps)
        if scale >= 1:
            return tuple(grads), total_norm
        return tuple(g * scale for g in grads), total_norm
