"""FSDP2 2.15's backward finalization and kept storage, on fullshard's units, with torch >= 2.13 installed.

``set_manual_backward_finalization(True)`` on the root: a backward that ends no longer completes the step. The
reductions autograd started during it still run; what it left unreduced (gradients accumulated without sync,
units whose post-backward never ran) and the end of the step (waiting for the reductions, resharding) wait for
``finalize_backward()``. That separates "all backward passes of a step are done" from any one backward call
(pipeline schedules, chunked losses). The mode is latched when a backward starts and holds until the step is
finalized or reset. ``finalize_backward(async_op=True)`` starts the remaining reductions and returns a
:class:`GradientReductionHandle`; its ``wait()`` completes them.

``set_keep_unsharded_storage(True)``: resharding shows the shards again but keeps the unsharded storage
(fullshard's own, the ``STALE`` gather state), and the next unshard gathers into it: the unsharded parameters
keep their data pointers across steps (CUDA graph capture), for the memory of every unit's unsharded
parameters.

The error messages are FSDP2's own words, so code that matches them works on both.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch.distributed import fsdp as torch_fsdp

from fullshard.core.unit import UNIT_ATTR, TrainingPhase
from fullshard.plan.group import AfterBackward

# torch 2.15's public handle class (for isinstance), or a plain base where the installed torch has none.
_TorchHandle: type = getattr(torch_fsdp, "GradientReductionHandle", object)


# FSDP2's communication context, as fullshard has it: each unit's ``_comm_ctx`` (torch/unit.py) says which
# asynchronous finalization is outstanding among the roots that share it (each root has its own unless
# share_comm_ctx joins them). fullshard issues its collectives on the current stream: no streams to share.
# torch.distributed.pipelining tells stages apart by ``_get_fsdp_state()._comm_ctx`` (defer_reduce_grad_wait).
def share_comm_ctx(modules: list) -> None:
    """FSDP2's ``share_comm_ctx``: the roots ``modules`` (pipeline stages) share one context, so none starts a
    forward or a finalization while another's asynchronous finalization is outstanding, and none resets it."""
    for module in modules:
        if getattr(module, UNIT_ATTR, None) is None:
            raise ValueError(f"Expects list of FSDPModules but got {module}")
    for module in modules[1:]:
        getattr(module, UNIT_ATTR)._comm_ctx = getattr(modules[0], UNIT_ATTR)._comm_ctx


class GradientReductionHandle(_TorchHandle):
    """Returned by ``finalize_backward(async_op=True)``: ``wait()`` completes the step's gradient reductions
    and ends its backward (a second ``wait()`` does nothing). ``reset_iter_state()`` invalidates it."""

    def __init__(self, root: Any = None) -> None:
        self.root = root  # the root whose step it completes; None once waited on (or for a handle of nothing)

    def wait(self) -> None:
        root = self.root
        if root is None:
            return
        context = root.unit._comm_ctx
        if context.active_reduction is not self:
            raise RuntimeError("This gradient reduction handle was invalidated")
        self.root = context.active_reduction = None
        _complete(root)


def defer_end_of_backward(root: Any) -> None:
    """Manual finalization: autograd's backward is over, the step is not. Reductions in flight stay in
    flight; what the backward left unreduced waits for ``finalize_backward`` (a later backward may add to it).
    Groups without gradient sync end their backward now, as in automatic mode (and FSDP2): resharded after
    backward, they do not stay gathered across micro-batches."""
    root.end_of_backward_queued = False
    for unit in root.units:
        unit.phase = TrainingPhase.IDLE
        for group in unit.groups:
            if not group.reduce_grads:
                group.after_reducing_backward()


def _complete(root: Any) -> None:
    root.complete_backward()  # waits for the reductions, then reshards or keeps as each group's policy says
    root.manual_active = None


def _replicated(group: Any) -> bool:
    return group.replicated or getattr(group, "replicate_group", None) is not None


def _check_finalizable(unit: Any) -> Any:
    root = unit.root
    outstanding = root.unit._comm_ctx.active_reduction
    if outstanding is not None and outstanding.root is root:
        raise RuntimeError("The previous gradient reduction must be waited on before finalizing backward again")
    if outstanding is not None:
        raise RuntimeError("Another gradient reduction sharing this communication context must be waited on before "
                           "finalizing backward")
    if not unit.is_root:
        raise RuntimeError("finalize_backward must be called on the root FSDP module")
    manual = root.manual_active if root.manual_active is not None else unit.manual_finalization
    if not manual:
        raise RuntimeError("FSDP finalize_backward requires manual backward finalization. Call "
                           "set_manual_backward_finalization(True) before forward")
    if root.end_of_backward_queued:
        raise RuntimeError("FSDP finalize_backward must be called after backward completes")
    if any(_replicated(group) and not group.all_reduce_grads for group in root.groups):
        root.finish_reduces()  # a partial sum (HSDP without the replica all-reduce) exists once it is reduced
    for group in root.groups:
        name = "<root>" if group in root.unit.groups else group.module_name  # FSDP2 names groups by path
        if getattr(group, "_partials", None):  # HSDP sums kept without the replica all-reduce
            raise RuntimeError(
                f"FSDP manual backward finalization does not support partial gradient reductions for parameter "
                f"group {name!r}. Use automatic backward finalization for this configuration")
        if _replicated(group) and group.reduce_grads and not group.all_reduce_grads and group.has_pending_grads():
            raise RuntimeError(
                f"FSDP manual backward finalization requires all-reduce for parameter group {name!r}. Call "
                "set_requires_all_reduce(True) before finalization")
    return root


class FinalizationMethods:
    """FSDP2 2.15's ``FSDPModule`` methods, on every torch fullshard supports (mixed into its ``FSDPModule``)."""

    def set_manual_backward_finalization(self, enabled: bool) -> None:
        """True: the caller ends each step with :meth:`finalize_backward` (call on the root, before backward;
        it holds until set back). It supersedes ``set_is_last_backward``."""
        unit = getattr(self, UNIT_ATTR)
        if unit.is_root is False:
            raise RuntimeError("set_manual_backward_finalization must be called on the root FSDP module")
        if enabled != unit.manual_finalization and torch._C._current_graph_task_id() != -1:
            raise RuntimeError("set_manual_backward_finalization cannot change mode during backward")
        active = unit.root.manual_active if unit.root is not None else None
        if active is not None and enabled != active:
            raise RuntimeError("set_manual_backward_finalization cannot change mode after backward starts")
        unit.manual_finalization = bool(enabled)

    def finalize_backward(self, *, async_op: bool = False) -> Optional[GradientReductionHandle]:
        """End the step's backward (manual finalization): reduce what the backward passes left unreduced, then
        wait for every reduction and reshard or keep as each group's policy says. ``async_op``: return a
        :class:`GradientReductionHandle` at once; its ``wait()`` does the waiting, before the gradients are read
        or the next forward. A no-op before the root's first forward."""
        unit = getattr(self, UNIT_ATTR)
        if unit.is_root is None or unit.root is None:
            return GradientReductionHandle() if async_op else None
        root = _check_finalizable(unit)
        with unit._profile("fullshard::root finalize_backward"):
            root.reduce_what_is_left()
            if not async_op:
                _complete(root)
                return None
            for group in root.groups:  # the unsharded parameters go now; the reductions hold what they read
                if group.after_backward is AfterBackward.RESHARD:
                    group.reshard()
        handle = root.unit._comm_ctx.active_reduction = GradientReductionHandle(root)
        return handle

    def set_keep_unsharded_storage(self, keep: bool, *, recurse: bool = True) -> None:
        """True: resharding keeps the unsharded storage allocated (the modules show the shards), and the next
        unshard gathers into it: stable data pointers (CUDA graphs) for the memory of the unsharded parameters.
        ``recurse``: every sharded module below this one too."""
        self._configure(recurse, keep_unsharded_storage=bool(keep))
