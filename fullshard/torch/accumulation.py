"""Gradients kept across backward passes without sync (``plan.ownership.Accumulation``), one parameter at a time.

Where autograd cannot sum them in the reduce dtype (torch 2.13/2.14 computing in bf16, reducing in fp32),
they go into an accumulator fullshard owns; on torch 2.15 the unsharded parameter holds them in the reduce
dtype (its ``grad_dtype``) and autograd sums into them. A group planned afresh between micro-batches rebuilds
its unsharded parameters: their pending gradients are carried over to the new ones. Nothing here runs in a
step that reduces every backward.
"""
from __future__ import annotations

from typing import Optional

import torch

from fullshard.torch import collectives
from fullshard.torch.collectives import Kind
from fullshard.torch.param import ShardedParam


def accumulate_grad_in(param: ShardedParam, dtype: torch.dtype) -> None:
    """Move autograd's gradient into the parameter's owned accumulator of ``dtype``."""
    grad, param.unsharded.grad = param.local_grad(param.unsharded.grad), None
    _accumulate(param, grad, dtype)


def _accumulate(param: ShardedParam, grad: Optional[torch.Tensor], dtype: torch.dtype) -> None:
    if grad is None:
        return
    if param.grad_accumulator is None:
        param.grad_accumulator = collectives.copy_of(grad, dtype, grad.device, f"gradient accumulator of '{param.fqn}'",
                                                     Kind.MAIN_GRAD)
        return
    with torch.no_grad():
        param.grad_accumulator.writable("accumulate a gradient").add_(grad)


def hold_grad(param: ShardedParam) -> None:
    """torch 2.15 (``Accumulation.CONVERTED_IN_AUTOGRAD``): a backward without sync gave the parameter its gradient,
    held in ``held_grad_dtype`` from here on (a new tensor if autograd's was in its own dtype) for the next
    backwards to sum into. That tensor is autograd's and the user's: fullshard reads it at the reduction and drops
    it, nothing more."""
    unsharded, dtype = param.unsharded, param.held_grad_dtype
    grad = unsharded.grad
    if grad is not None and grad.dtype != dtype:
        unsharded.grad = None  # torch refuses a grad_dtype the current gradient does not have
        unsharded.grad_dtype = dtype
        unsharded.grad = grad.to(dtype)
    else:
        unsharded.grad_dtype = dtype


def carry_grad(param: ShardedParam) -> None:
    """The unsharded parameter, which holds a pending gradient, is about to be rebuilt (its group is planned
    afresh): the gradient goes to the next one (``take_carried_grad``), for the user's code to see, clear or edit
    as before."""
    param.carried_grad, param.unsharded.grad = param.unsharded.grad, None


def take_carried_grad(param: ShardedParam) -> None:
    grad, param.carried_grad = param.carried_grad, None
    try:
        param.unsharded.grad = grad
    except RuntimeError:  # torch refuses it (converted since: another dtype or device): kept apart, in its dtype
        _accumulate(param, param.local_grad(grad), grad.dtype)
