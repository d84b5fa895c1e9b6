"""Per-``fully_shard`` state: forward/backward hooks and the root's end of backward.

Life of a group in one step (ZeRO-3):

* pre-forward: all-gather (wait), register unsharded parameters, cast inputs;
* post-forward: register sharded parameters again (so ``parameters()`` and
  ``state_dict()`` always show shards), reshard if asked, hook the outputs so
  the group is all-gathered again when backward reaches it, cast outputs;
* backward: once every trainable parameter of the group has its gradient,
  reduce-scatter them (asynchronously) and reshard;
* end of backward (the root's callback): flush groups that did not finish,
  wait for every reduction, install sharded gradients, reshard the rest.

The first module whose forward runs while no other is running is the *root*
of that forward: it lazily initializes every state below it.
"""
from __future__ import annotations

import threading
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.autograd import Variable
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten, tree_map

from fullshard.torch import buffers
from fullshard.plan.strategy import Lifecycle, Strategy, lifecycle
from fullshard.torch.policies import MixedPrecisionPolicy
from fullshard.torch import checks
from fullshard.torch.collectives import PendingReduce
from fullshard.torch.group import GroupState, ParamGroup

_active = threading.local()


def _active_root() -> Optional["ShardState"]:
    return getattr(_active, "root", None)


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class ShardState:
    def __init__(
        self,
        modules: list[nn.Module],
        group: Optional[ParamGroup],
        mp_policy: MixedPrecisionPolicy,
        reshard_after_forward: Optional[bool],
        strategy: Strategy,
    ) -> None:
        self.modules = modules
        self.group = group
        self.mp_policy = mp_policy
        self.strategy = strategy
        self._reshard_after_forward = reshard_after_forward
        self.is_root: Optional[bool] = None
        self.root: Optional[ShardState] = None
        self.subtree: list[ShardState] = []  # root only: every state under it, in module order
        # Explicit prefetch targets (set_modules_to_*_prefetch); empty: the implicit
        # neighbour in the order the root recorded during its first forward.
        self.forward_prefetch: list[ShardState] = []
        self.backward_prefetch: list[ShardState] = []
        # Root only: units in the order their forward began, and in the order it ended.
        # Backward runs in the reverse of the second: the root's head, whose
        # forward ends last, first; then the last block, and so on.
        self._forward_order: list[ShardState] = []
        self._post_forward_order: list[ShardState] = []
        self._order_recorded = False  # root only
        self._forward_done: set[int] = set()
        self._final_callback_queued = False
        self._forward_thread: Optional[int] = None
        self._pending_reduces: list[PendingReduce] = []
        self.post_optim_event: Any = None  # root only: FSDPModule.set_post_optim_event
        if group is not None:
            group.on_grad_ready = self._on_grad_ready
        for module in modules:
            module.register_state_dict_pre_hook(self._before_state_dict)
            module.register_load_state_dict_pre_hook(self._before_load_state_dict)
            module.register_forward_pre_hook(self._pre_forward, prepend=True, with_kwargs=True)
            # always_call: a forward that raises still restores the sharded registration and the root marker
            module.register_forward_hook(self._post_forward, prepend=False, always_call=True)

    @property
    def lifecycle(self) -> Lifecycle:
        return lifecycle(self.strategy, bool(self.is_root), self._reshard_after_forward)

    @property
    def reshard_after_forward(self) -> bool:
        return self.lifecycle.reshard_after_forward

    @reshard_after_forward.setter
    def reshard_after_forward(self, value: bool) -> None:
        self._reshard_after_forward = value

    def _before_state_dict(self, *_args: Any) -> None:
        """The tensors state_dict() returns may be written (dcp.load writes into them, below any
        version counter fullshard can see): gather a kept unsharded copy again before its next use."""
        if self.group is not None and self.group.state is GroupState.UNSHARDED and not _in_backward():
            self.group.mark_stale()

    def _before_load_state_dict(self, module: nn.Module, state_dict: dict, prefix: str, *_args: Any) -> None:
        """Accept full (plain) tensors for sharded parameters: keep this rank's shard of each.

        (Sharded DTensors load as they are; a kept unsharded copy is refreshed
        at the next forward because the shards' versions change.)
        """
        if self.group is None:
            return
        paths = {id(m): name for name, m in module.named_modules()}
        for param in self.group.params:
            for owner, attr in param.owners:
                if id(owner) not in paths:
                    continue
                key = f"{prefix}{paths[id(owner)]}.{attr}" if paths[id(owner)] else f"{prefix}{attr}"
                value = state_dict.get(key)
                if isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and tuple(value.shape) == param.layout.shape:
                    state_dict[key] = param.full_to_sharded(value)

    # ------------------------------------------------------------------ lazy init
    def _lazy_init_as_root(self) -> None:
        if self.is_root is not None and self.root is self:
            return
        self._build_subtree()
        self._check_ranks_agree()

    def _check_ranks_agree(self) -> None:
        """Fail at the first step, not hang later, if ranks wrapped different models."""
        groups = [s.group for s in self.subtree if s.group is not None]
        if not groups:
            return
        layout = [
            (p.fqn, p.layout.shape, p.layout.dim, str(p.stored_dtype), str(p.compute_dtype), p.requires_grad)
            for group in groups for p in group.params
        ]
        # Ranks that move bytes differently (FULLSHARD_EXCHANGE set on some only) would wait on each other forever.
        layout += [(f"exchange of module '{group.module_name}'", group.exchange.value) for group in groups]
        process_group = groups[0].process_group
        everyone: list = [None] * dist.get_world_size(process_group)
        dist.all_gather_object(everyone, layout, group=process_group)
        for rank, other in enumerate(everyone):
            if other != layout:
                mine, theirs = _first_difference(layout, other)
                raise RuntimeError(
                    f"fully_shard: rank {dist.get_rank()} and group rank {rank} wrapped different models "
                    f"(first difference: {mine} here vs {theirs} there); every rank must build the same "
                    "model, apply fully_shard the same way and set FULLSHARD_EXCHANGE alike (or nowhere)"
                )

    def _build_subtree(self) -> None:
        self.is_root, self.root = True, self
        self.subtree = [self]
        seen = {id(self)}
        for module in self.modules:
            for name, sub in module.named_modules():
                state = getattr(sub, "_fullshard_state", None)
                if state is None or id(state) in seen:
                    continue
                seen.add(id(state))
                if state.is_root is None or state.root is not self:
                    state.is_root, state.root = False, self
                if state.group is not None:
                    state.group.rename(name)  # errors and labels name parameters from the root
                self.subtree.append(state)

    # ------------------------------------------------------------------ forward
    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        self._check_not_used_during_backward(module)
        # A forward inside backward is activation checkpointing recomputing a unit:
        # it belongs to the step already running, so it never becomes a root.
        if _active_root() is None and not _in_backward():
            self._lazy_init_as_root()
            _active.root = self
            self._forward_thread = threading.get_ident()
            groups = [s.group for s in self.subtree if s.group is not None]
            if checks.check_inputs_enabled() and groups:
                checks.check_same_input_shapes(args, kwargs, type(module).__name__, groups[0].process_group)
            for state in self.subtree:  # cheap identity checks: re-adopt replaced parameters
                if state.group is not None:
                    state.group.refresh_sharded()
            if self.post_optim_event is not None:
                self.post_optim_event.wait()  # the gathers below run on the current stream
                self.post_optim_event = None
        if self.group is not None:
            if not _in_backward() and torch.is_grad_enabled():
                self.group.ran_forward = True  # a forward that may have a backward
            root = self.root or self
            if not root._order_recorded and self not in root._forward_order:
                root._forward_order.append(self)
            self.group.unshard()
            if not _in_backward():
                # issued before waiting for this unit's own: both transfers in flight at once
                self._prefetch(self.forward_prefetch or self._neighbour(+1))
            self.group.wait_for_unshard()
            self.group.register_unsharded()
        dtype = self.mp_policy.param_dtype
        if dtype is not None and self.mp_policy.cast_forward_inputs:
            args, kwargs = _cast_floats((args, kwargs), dtype)
        return args, kwargs

    def _post_forward(self, module: nn.Module, args: tuple, output: Any) -> Any:
        if self.group is not None:
            # A recomputation (activation checkpointing) inside this unit's backward keeps the
            # unsharded parameters shown: a checkpoint nested inside may still recompute.
            if not (_in_backward() and self.group.shown_for_backward):
                self.group.register_sharded()
            self._forward_done.add(id(module))
            all_ran = len(self._forward_done) == len(self.modules)
            if all_ran:
                self._forward_done.clear()
                root = self.root or self
                if not root._order_recorded and not _in_backward() and self not in root._post_forward_order:
                    root._post_forward_order.append(self)
                if self.reshard_after_forward and not _in_backward():
                    self.group.reshard_after_forward()
            if torch.is_grad_enabled():
                self._hook_outputs_for_backward(output)
        if self.mp_policy.output_dtype is not None:
            output = _cast_floats(output, self.mp_policy.output_dtype)
        if _active_root() is self:
            self._finish_root_forward()
            _active.root = None
        return output

    def _check_not_used_during_backward(self, module: nn.Module) -> None:
        """A forward from another thread while this model's backward runs would race on its buffers."""
        root = self.root or self
        if not root._final_callback_queued or _in_backward():
            return  # no backward in flight, or a recomputation inside it (activation checkpointing)
        if threading.get_ident() == root._forward_thread:
            # The same thread is not inside that backward any more: it raised. Start clean.
            root.reset_step()
            return
        raise RuntimeError(
            f"{type(module).__name__} (fully_shard) was called from another thread while its backward is "
            "running on the thread that ran its forward; run forward and backward of one model from one thread"
        )

    def reset_step(self) -> None:
        """Abandon the step in flight (it raised): pending reductions and unreduced gradients are
        dropped, every unit is resharded and shows its sharded parameters."""
        root = self.root or self
        root._final_callback_queued = False
        for reduce in root._pending_reduces:
            # The transfer may still be writing into the buffers: let it end before they are let go.
            try:
                reduce.work.wait()
            except Exception:  # the step is abandoned either way; only the buffers' lifetime matters
                pass
            buffers.release_all(reduce.transient)
            if reduce.output is not None:
                reduce.output.reclaim()
        root._pending_reduces.clear()
        _active.root = None
        for state in root.subtree or [root]:
            group = state.group
            if group is not None:
                group.reset_backward()
                group.abandon_step()
                group.reshard()
                group.register_sharded()

    def _finish_root_forward(self) -> None:
        self._order_recorded = True
        # Groups of several modules where not all ran still follow their policy.
        for state in self.subtree:
            state._forward_done.clear()
            if state.group is not None and state.reshard_after_forward and state is not self:
                state.group.reshard_after_forward()

    def _hook_outputs_for_backward(self, output: Any) -> None:
        tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if tensors:
            torch.autograd.graph.register_multi_grad_hook(tensors, self._pre_backward, mode="any")

    # ------------------------------------------------------------------ backward
    def _pre_backward(self, _grad: Any) -> None:
        self._queue_final_callback()
        group = self.group
        if group.unshard_in_backward:
            group.unshard()
        self._prefetch(self.backward_prefetch or self._neighbour(-1))
        if not group.unshard_in_backward:
            return
        group.wait_for_unshard()
        # Shown to the module until its backward is done: activation checkpointing
        # inside this unit recomputes through submodules that have no hooks of ours.
        group.register_unsharded()
        group.shown_for_backward = True

    def _neighbour(self, offset: int) -> list["ShardState"]:
        """The unit that runs next in forward (+1) or in backward (-1), from the order recorded in forward."""
        root = self.root or self
        order = root._forward_order if offset > 0 else root._post_forward_order
        if not root._order_recorded or self not in order:
            return []
        index = order.index(self) + offset
        return [order[index]] if 0 <= index < len(order) else []

    @staticmethod
    def _prefetch(states: list["ShardState"]) -> None:
        """Issue these units' all-gathers now, to overlap with the current unit's compute."""
        backward = _in_backward()
        for other in states:
            if other.group is not None and (other.group.unshard_in_backward or not backward):
                other.group.unshard()

    def _queue_final_callback(self) -> None:
        root = self.root or self
        if not root._final_callback_queued:
            root._final_callback_queued = True
            Variable._execution_engine.queue_callback(root._end_of_backward)

    def _on_grad_ready(self, group: ParamGroup) -> None:
        self._queue_final_callback()
        # With reduce_unused_params, which gradients arrive differs between ranks, so
        # "all arrived" would order reductions differently on each: those groups
        # reduce at the end of backward instead, in module order on every rank.
        if group.all_grads_ready and not group.backward_done and not group.reduce_unused_params:
            self._finish_group_backward(group)

    def _finish_group_backward(self, group: ParamGroup) -> None:
        group.backward_done = True
        root = self.root or self
        if group.reduce_grads and not self.lifecycle.reduce_at_end_of_backward:
            # Keep at most one bucket set in flight: finishing the previous
            # reductions here bounds memory and overlaps them with this backward.
            root._finish_reduces()
            root._pending_reduces.extend(group.reduce())
        # A group with frozen parameters may still be needed by backward ops
        # that only compute input gradients: it is resharded at the end instead.
        if group.reshard_after_backward and len(group.trainable) == len(group.params):
            group.reshard()
            group.register_sharded()
            group.shown_for_backward = False

    def _finish_reduces(self) -> None:
        pending, self._pending_reduces = self._pending_reduces, []
        for reduce in pending:
            reduce.finish()

    def _end_of_backward(self) -> None:
        for state in self.subtree:
            group = state.group
            if group is None or group.backward_done:
                continue
            # Some gradients but not all (unused parameters); or, with reduce_unused_params,
            # none at all on this rank while others may have some: every rank must reduce.
            if group.has_unfinished_grads or (group.reduce_unused_params and group.ran_forward):
                state._finish_group_backward(group)
        # ZeRO-1 reduces every group once, here, in the same order on every rank.
        for state in reversed(self.subtree):
            group = state.group
            if group is not None and group.reduce_grads and state.lifecycle.reduce_at_end_of_backward:
                self._pending_reduces.extend(group.reduce())
        self.complete_backward()

    def reduce_accumulated_grads(self) -> None:
        """Reduce this unit's accumulated gradients now, outside autograd.

        torch.distributed.pipelining does this after its last micro-batch (sync
        back on), then calls :meth:`complete_backward` on the stage's root.
        """
        group = self.group
        if group is not None and group.reduce_grads:
            group.backward_done = True
            (self.root or self)._pending_reduces.extend(group.reduce())

    def complete_backward(self) -> None:
        """Wait for the reductions in flight, then reshard and show the shards (root only)."""
        self._finish_reduces()
        offloaded = [s.group for s in self.subtree if s.group is not None and s.group.offloaded_to_host]
        if offloaded:
            # gradients copied to pinned host memory without blocking: done before the optimizer reads them
            getattr(torch, offloaded[0].params[0].device.type).synchronize()
        for state in self.subtree:
            group = state.group
            if group is None:
                continue
            if group.reshard_after_backward:
                group.reshard()
            elif group.reduce_grads and group.backward_done:
                group.mark_stale()  # the optimizer will change the shards: gather again next forward
            group.register_sharded()  # at rest, modules show their sharded parameters
            group.reset_backward()
        self._final_callback_queued = False
        groups = [s.group for s in self.subtree if s.group is not None]
        if checks.check_finite_enabled() and groups:
            checks.raise_if_any(groups[0].process_group)


def _first_difference(mine: list, theirs: list) -> tuple:
    for a, b in zip(mine, theirs):
        if a != b:
            return a, b
    return (f"{len(mine)} parameters", f"{len(theirs)} parameters")


def _cast_floats(tree: Any, dtype: torch.dtype) -> Any:
    def cast(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
            return x.to(dtype)
        return x

    return tree_map(cast, tree)
