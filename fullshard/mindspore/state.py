"""Per-``fully_shard`` state: the Cell hooks that move a unit through its phases (``fullshard.core.lifecycle``).

Life of a unit in one step (ZeRO-3), inside ``value_and_grad``:

* pre-forward: gather (unless a right copy is kept) and show the unsharded
  tensors through each bucket's differentiable gather; cast inputs;
* post-forward: show the shards again; reshard if asked (free the storage:
  the tensors autograd saved stay, empty);
* pre-backward (the unit's backward pre-hook, when its outputs' gradients
  arrive): gather into the freed storage again; the root's first one queues
  the end-of-backward callback;
* each bucket's bprop: reduce, return this rank's shards of the gradients;
  after the unit's last one, reshard (post-backward);
* end of backward (the root's callback, ``root.py``): reshard what is left,
  mark kept copies stale, reset.
"""
from __future__ import annotations

import threading
from typing import Any, Iterator, Optional

from mindspore import Tensor, nn

from fullshard.core.lifecycle import TrainingPhase
from fullshard.core.units import RootedUnit, named_under
from fullshard.core.trees import map_leaves
from fullshard.mindspore.autograd import recording
from fullshard.mindspore.group import ParamGroup
from fullshard.mindspore.policies import FLOAT_DTYPES, MixedPrecisionPolicy
from fullshard.mindspore.root import RootContext
from fullshard.plan.strategy import Lifecycle, Strategy, lifecycle

_active = threading.local()


def _active_root() -> Optional["ShardState"]:
    return getattr(_active, "root", None)


class ShardState(RootedUnit):
    root_context, active = RootContext, _active

    def __init__(
        self,
        cells: list[nn.Cell],
        groups: list[ParamGroup],
        mp_policy: MixedPrecisionPolicy,
        reshard_after_forward: Optional[bool],
        strategy: Strategy,
    ) -> None:
        super().__init__(mp_policy, strategy, reshard_after_forward)
        self.cells = cells
        self.groups = groups  # the sharded parameters' group and/or the replicated ones'
        self._recorded = False  # this pass's forward is recorded for a gradient
        self.pending_bprops = 0  # bucket bprops still to come for the recorded forwards
        for group in groups:
            group.on_bucket_reduced = self._on_bucket_reduced
        for cell in cells:
            cell.register_forward_pre_hook(self._pre_forward, prepend=True, with_kwargs=True)
            # always_call: a forward that raises still restores the root marker
            cell.register_forward_hook(self._post_forward, always_call=True)
            cell.register_backward_pre_hook(self._pre_backward)

    @property
    def lifecycle(self) -> Lifecycle:
        # Gradients leave through each bucket's bprop as shards: nothing can wait for the end of backward.
        return lifecycle(self.strategy, bool(self.is_root), self._reshard_after_forward, defers_reduction=False)

    @property
    def name(self) -> str:
        if self.groups:
            return self.groups[0].module_name
        return ", ".join(type(c).__name__ for c in self.cells)

    # ------------------------------------------------------------------ lazy init (core.units.RootedUnit)
    def _named_submodules(self) -> Iterator[tuple[str, nn.Cell]]:
        return named_under(self.cells, nn.Cell.cells_and_names)

    # ------------------------------------------------------------------ forward
    def _pre_forward(self, cell: nn.Cell, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        context = self._ensure_context()
        if self.is_root and _active_root() is None:
            _active.root = self
            context.begin_step()
        if not self._forward_done:  # the first cell of this unit in this pass gathers the whole group
            self.phase = TrainingPhase.PRE_FORWARD
            self._recorded = recording()
            for group in self.groups:
                group.gather_for_forward()
            if self._recorded:
                self.forwards_with_grad += 1
                self.pending_bprops += sum(
                    1 for g in self.groups for i in range(len(g.plan.buckets)) if g.plan.members(i)[0].requires_grad
                )
            for other in self.forward_prefetch:
                other.prefetch()
            self.phase = TrainingPhase.FORWARD
        else:
            for group in self.groups:
                group.unsharder.show()
        self._forward_done.add(id(cell))
        dtype = self.mp_policy.param_dtype
        if dtype is not None and self.mp_policy.cast_forward_inputs:
            args, kwargs = _cast_floats(args, dtype), _cast_floats(kwargs, dtype)
        return args, kwargs

    def prefetch(self) -> None:
        """Gather this unit's parameters now, for its forward to come (a no-op when they are gathered)."""
        for group in self.groups:
            group.unsharder.unshard()

    def _post_forward(self, cell: nn.Cell, args: tuple, output: Any) -> Any:
        if len(self._forward_done) >= len(self.cells):
            self._release_after_forward()
        if self.mp_policy.output_dtype is not None:
            output = _cast_floats(output, self.mp_policy.output_dtype)
        if self.is_root and _active_root() is self:
            _active.root = None
            self.context.finish_forward()
        return output

    def _release_after_forward(self) -> None:
        self._forward_done.clear()
        self.phase = TrainingPhase.IDLE
        for group in self.groups:
            unsharder = group.unsharder
            if unsharder.requested:
                continue  # an explicit unshard(): the cells show the unsharded tensors until reshard()
            if not self._recorded:
                # no backward will come: free the storage, or keep it for the next forward to refresh
                unsharder.reshard() if self.reshard_after_forward else unsharder.mark_stale()
            elif self.reshard_after_forward:
                unsharder.reshard()
            else:
                unsharder.hide()  # kept for backward; the cells show their shards between steps

    def finish_partial_forward(self) -> None:
        """At the root's post-forward: a unit of several cells where not all ran, or one prefetched but not
        run, still follows its policy (an explicit unshard() is left for the next forward)."""
        if self._forward_done:
            self._release_after_forward()
            return
        for group in self.groups:
            if group.unsharder.gathered_but_unused():
                group.unsharder.reshard() if self.reshard_after_forward else group.unsharder.mark_stale()

    # ------------------------------------------------------------------ backward
    def _pre_backward(self, cell: nn.Cell, grad_output: Any) -> None:
        context = self.context
        if context is None:
            return None
        context.queue_final_callback()
        if self.phase is not TrainingPhase.PRE_BACKWARD:
            self.phase = TrainingPhase.PRE_BACKWARD
            for group in self.groups:
                group.unsharder.refill_for_backward()
            for other in self.backward_prefetch:
                for group in other.groups:
                    group.unsharder.refill_for_backward()
        return None

    def _on_bucket_reduced(self) -> None:
        """A bucket's bprop reduced; after the unit's last one its backward is done: reshard."""
        self.pending_bprops -= 1
        if self.pending_bprops > 0:
            return
        self.phase = TrainingPhase.POST_BACKWARD
        for group in self.groups:
            if group.reshard_after_backward:
                group.unsharder.reshard()
                group.unsharder.release_saved()

    def end_backward(self) -> None:
        """The root's end of backward: free what no bprop freed, mark kept copies stale, reset."""
        for group in self.groups:
            if group.reshard_after_backward:
                group.unsharder.reshard()
            elif group.reducer.reduce_grads:
                # reduced: the optimizer will change the shards; the storage stays for the next gather (ZeRO-1/2)
                group.unsharder.mark_stale()
            group.unsharder.release_saved()
        self.phase = TrainingPhase.IDLE
        self.forwards_with_grad = 0
        self.pending_bprops = 0

    def reset_step(self) -> None:
        """Abandon the step in flight (it raised): forget kept gradients, reshard, show the shards."""
        for group in self.groups:
            group.reducer.abandon_step()
            group.unsharder.abandon()
        self._forward_done.clear()
        self.phase = TrainingPhase.IDLE
        self.forwards_with_grad = 0
        self.pending_bprops = 0


def _cast_floats(tree: Any, dtype: Any) -> Any:
    return map_leaves(lambda x: x.astype(dtype) if x.dtype in FLOAT_DTYPES and x.dtype != dtype else x, tree, Tensor)
