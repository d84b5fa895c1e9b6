"""Per-``fully_shard`` state: the hooks that move a unit through its phases (``fullshard.core.phases``).

Life of a unit in one step (ZeRO-3):

* pre-forward: all-gather (wait; the modules now show the unsharded
  parameters), cast inputs, and put an identity node on the inputs whose
  backward marks the end of this unit's backward;
* post-forward: reshard if asked (the modules show the shards again), hook
  the outputs so the unit is gathered again when backward reaches it;
* pre-backward: all-gather again, prefetch the next unit;
* post-backward (the input node's backward): autograd has now computed every
  gradient this forward gives the unit's parameters, and sums them before it
  runs that node (AccumulateGrad runs first), so the gradients are reduced
  here and the unit resharded. No count of gradient arrivals can know this: a
  parameter used by two reentrant checkpoint segments receives two;
* end of backward (the root's callback, ``root.py``): reduce what no
  post-backward did (units whose inputs need no gradient, gradients that came
  late), wait for every reduction, reshard.
"""
from __future__ import annotations

import threading
import weakref
from typing import Any, Iterator, Optional

import torch
import torch.nn as nn
from torch.autograd.graph import register_multi_grad_hook
from torch.distributed.tensor import DTensor
from torch.profiler import record_function

from fullshard.core.phases import TrainingPhase
from fullshard.core.units import RootedUnit, named_under
from fullshard.plan.strategy import AfterBackward, Lifecycle, Strategy, lifecycle
from fullshard.torch import checks
from fullshard.torch.group import ParamGroup
from fullshard.torch.policies import MixedPrecisionPolicy
from fullshard.torch.root import RootContext
from fullshard.torch.trees import map_tensors, tensors_in
from fullshard.torch.unshard import GroupState

_active = threading.local()


def _active_root() -> Optional["ShardState"]:
    return getattr(_active, "root", None)


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's forward inputs; its backward runs once the unit's backward for that forward is done."""

    @staticmethod
    def forward(ctx: Any, state_ref: weakref.ref, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.state_ref = state_ref
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        state = ctx.state_ref()
        if state is not None:
            state.post_backward()
        return (None, *grads)


class ShardState(RootedUnit):
    root_context, active = RootContext, _active

    def __init__(
        self,
        modules: list[nn.Module],
        group: Optional[ParamGroup],
        mp_policy: MixedPrecisionPolicy,
        reshard_after_forward: Optional[bool],
        strategy: Strategy,
    ) -> None:
        super().__init__(mp_policy, strategy, reshard_after_forward)
        self.modules = modules
        self.group = group
        if group is not None:
            group.reducer.on_grad = self._on_grad
        for module in modules:
            module.register_state_dict_pre_hook(self._before_state_dict)
            module.register_load_state_dict_pre_hook(self._before_load_state_dict)
            # torch.compile traces the module's own forward and leaves the hooks to run eagerly
            # (a graph break at each unit's edges): they issue collectives, wait on them and swap
            # registered parameters, none of which belongs in a traced graph.
            module.register_forward_pre_hook(torch.compiler.disable(self._pre_forward), prepend=True, with_kwargs=True)
            # always_call: a forward that raises still restores the root marker
            module.register_forward_hook(torch.compiler.disable(self._post_forward), prepend=False, always_call=True)

    @property
    def lifecycle(self) -> Lifecycle:
        return lifecycle(self.strategy, bool(self.is_root), self._reshard_after_forward)

    @property
    def groups(self) -> list[ParamGroup]:
        return [self.group] if self.group is not None else []

    @property
    def reduces_at_end_of_backward(self) -> bool:
        return self.lifecycle.reduce_at_end_of_backward

    def label(self, what: str) -> str:
        """A profiler label: ``fullshard::<phase> <what> (<module fqn>)``."""
        name = self.group.module_name if self.group is not None else type(self.modules[0]).__name__
        return f"fullshard::{self.phase} {what} ({name})"

    # ------------------------------------------------------------------ state dict
    def _before_state_dict(self, *_args: Any) -> None:
        """state_dict() returns the shards (FSDP2 does the same). The tensors it returns may be written
        (dcp.load writes into them, below any version counter): a kept copy is gathered again."""
        if self.group is not None and self.group.state is not GroupState.SHARDED and not _in_backward():
            self.group.unsharder.mark_stale()

    def _before_load_state_dict(self, module: nn.Module, state_dict: dict, prefix: str, *_args: Any) -> None:
        """Load into the shards, accepting full (plain) tensors for sharded parameters: keep this rank's
        shard of each. A kept unsharded copy is gathered again at the next forward."""
        if self.group is None:
            return
        self._before_state_dict()
        paths = {id(m): name for name, m in module.named_modules()}
        for param in self.group.params:
            for owner, attr in param.owners:
                if id(owner) not in paths:
                    continue
                key = f"{prefix}{paths[id(owner)]}.{attr}" if paths[id(owner)] else f"{prefix}{attr}"
                value = state_dict.get(key)
                if isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and value.shape == param.spec.shape:
                    state_dict[key] = param.full_to_sharded(value)

    # ------------------------------------------------------------------ lazy init (core.units.RootedUnit)
    def _named_submodules(self) -> Iterator[tuple[str, nn.Module]]:
        return named_under(self.modules, nn.Module.named_modules)

    # ------------------------------------------------------------------ forward
    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        group = self.group
        if _in_backward() and self.phase is TrainingPhase.PRE_BACKWARD:
            # Activation checkpointing recomputes this unit inside its own backward: it
            # already shows the unsharded parameters (a nested use may have resharded them).
            if group is not None and group.unshard_in_backward:
                self._unshard_now("all-gather")
            return self._cast_inputs(args, kwargs)
        self._check_not_used_during_backward(module)
        # A forward inside backward is activation checkpointing recomputing a unit:
        # it belongs to the step already running, so it never becomes a root.
        if _active_root() is None and not _in_backward():
            context = self._lazy_init_as_root()
            _active.root = self
            groups = context.groups
            if checks.check_inputs_enabled() and groups:
                checks.check_same_input_shapes(args, kwargs, type(module).__name__, groups[0].process_group)
            context.begin_step()
        first_in_pass = self.phase is not TrainingPhase.FORWARD  # fully_shard([a, b]): once per pass
        if group is not None:
            self.phase = TrainingPhase.PRE_FORWARD
            self._ensure_context().record_forward(self, ended=False)
            with record_function(self.label("all-gather")):
                group.unsharder.unshard()
                if not _in_backward():
                    # issued before waiting for this unit's own: both transfers in flight at once
                    self._prefetch(self.forward_prefetch or self.context.neighbour(self, +1))
                group.unsharder.wait_for_unshard()
        self.phase = TrainingPhase.FORWARD
        if group is not None and first_in_pass and torch.is_grad_enabled():
            args, kwargs = self._register_post_backward((args, kwargs))
        return self._cast_inputs(args, kwargs)

    def _register_post_backward(self, inputs: Any) -> Any:
        tensors = [t for t in tensors_in(inputs) if t.requires_grad]
        if not tensors:
            return inputs  # no backward reaches the inputs: the root's end of backward reduces this unit
        passed_through = _PostBackward.apply(weakref.ref(self), *tensors)
        replacement = {id(t): out for t, out in zip(tensors, passed_through)}
        return map_tensors(lambda t: replacement.get(id(t), t), inputs)

    def _cast_inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        dtype = self.mp_policy.param_dtype
        if dtype is None or not self.mp_policy.cast_forward_inputs:
            return args, kwargs
        return _cast_floats((args, kwargs), dtype)

    def _post_forward(self, module: nn.Module, args: tuple, output: Any) -> Any:
        if not (_in_backward() and self.phase is TrainingPhase.PRE_BACKWARD) and self.group is not None:
            # Outputs that need a gradient: a backward will come through this unit.
            if torch.is_grad_enabled() and self._hook_outputs_for_backward(output) and not _in_backward():
                self.forwards_with_grad += 1
            self._forward_done.add(id(module))
            if len(self._forward_done) == len(self.modules):
                self._forward_done.clear()
                if not _in_backward():
                    self.context.record_forward(self, ended=True)
                    self._release_after_forward()
                self.group.unsharder.keep_for_next_forward = False  # used up by this forward
                self.phase = TrainingPhase.IDLE
        if self.mp_policy.output_dtype is not None:
            output = _cast_floats(output, self.mp_policy.output_dtype)
        if _active_root() is self:
            if self.context is not None and self is self.context.root:
                self.context.finish_forward()
            _active.root = None
        return output

    def _release_after_forward(self) -> None:
        """After forward, keep what backward needs, as the policy says. Without a forward whose outputs need a
        gradient since the last backward, no backward is to come: the unit shows its shards again, so a write
        through ``model.parameters()`` (``p.data.copy_``) lands in the shards, and the next forward
        gathers it (a kept storage is reused)."""
        unsharder = self.group.unsharder
        with record_function(self.label("reshard")):
            if not self.forwards_with_grad:
                unsharder.reshard() if self.reshard_after_forward else unsharder.mark_stale()
            elif self.reshard_after_forward:
                unsharder.reshard_after_forward()

    def finish_partial_forward(self) -> None:
        """At the root's post-forward: a group of several modules where not all ran, or one prefetched
        but not run, still follows its policy (an explicit unshard() is left for the next forward)."""
        if self._forward_done:
            self._forward_done.clear()
            self.phase = TrainingPhase.IDLE
        if self.group is not None and not self.is_root and not self.group.unsharder.keep_for_next_forward:
            self._release_after_forward()

    def _check_not_used_during_backward(self, module: nn.Module) -> None:
        """A forward from another thread while this model's backward runs would race on its buffers."""
        context = self.context
        if context is None or not context.final_callback_queued or _in_backward():
            return  # no backward in flight, or a recomputation inside it (activation checkpointing)
        if threading.get_ident() == context.forward_thread:
            # The same thread is not inside that backward any more: it raised. Start clean.
            context.reset_step()
            return
        raise RuntimeError(
            f"{type(module).__name__} (fully_shard) was called from another thread while its backward is "
            "running on the thread that ran its forward; run forward and backward of one model from one thread"
        )

    def reset_step(self) -> None:
        """FSDPModule.reset_iter_state: abandon the step in flight (call on the root)."""
        (self.context or RootContext(self)).reset_step()
        _active.root = None

    def _hook_outputs_for_backward(self, output: Any) -> bool:
        """Gather this unit again when backward reaches its outputs; False if none needs a gradient."""
        tensors = [t for t in tensors_in(output) if t.requires_grad]
        if tensors:
            # Autograd keeps the hook in C++, out of reach of Python's cycle collector: a strong
            # reference to this state would keep the whole model alive once it is dropped.
            state_ref = weakref.ref(self)

            def pre_backward(grad: Any) -> None:
                state = state_ref()
                if state is not None:
                    state._pre_backward(grad)

            register_multi_grad_hook(tensors, pre_backward, mode="any")
        return bool(tensors)

    # ------------------------------------------------------------------ backward
    def _pre_backward(self, _grad: Any) -> None:
        if self.phase is TrainingPhase.PRE_BACKWARD:
            return
        self.context.queue_final_callback()
        self.phase = TrainingPhase.PRE_BACKWARD
        group = self.group
        with record_function(self.label("all-gather")):
            if group.unshard_in_backward:
                group.unsharder.unshard()
            self._prefetch(self.backward_prefetch or self.context.neighbour(self, -1))
            if group.unshard_in_backward:
                group.unsharder.wait_for_unshard()

    def _unshard_now(self, what: str) -> None:
        with record_function(self.label(what)):
            self.group.unsharder.unshard()
            self.group.unsharder.wait_for_unshard()

    def _prefetch(self, states: list["ShardState"]) -> None:
        """Issue these units' all-gathers now, to overlap with the current unit's compute."""
        backward = _in_backward()
        for other in states:
            if other.group is not None and (other.group.unshard_in_backward or not backward):
                with record_function(other.label("prefetch all-gather")):
                    other.group.unsharder.unshard()

    def _on_grad(self) -> None:
        self.context.queue_final_callback()

    def post_backward(self) -> None:
        """This unit's backward for one forward is done: reduce its gradients and reshard."""
        group = self.group
        self.phase = TrainingPhase.POST_BACKWARD
        reducer = group.reducer
        # With reduce_unused_params, which gradients arrive differs between ranks, so
        # those groups reduce at the end of backward instead, in module order on every rank.
        if (reducer.reduce_grads and not self.reduces_at_end_of_backward and not reducer.reduce_unused_params
                and reducer.has_pending_grads()):
            self.context.start_reduce(self)
        if group.after_backward is AfterBackward.RESHARD:
            with record_function(self.label("reshard")):
                group.unsharder.reshard()

    def reduce_leftovers(self) -> None:
        """At the end of backward: reduce gradients no post-backward reduced (inputs that need no
        gradient, gradients that came late), and every reduce_unused_params unit that ran forward."""
        group = self.group
        if group is None or not group.reducer.reduce_grads or self.reduces_at_end_of_backward:
            return
        if group.reducer.reduce_unused_params:
            if self.forwards_with_grad:
                self.context.start_reduce(self)
        elif group.reducer.has_pending_grads():
            self.phase = TrainingPhase.POST_BACKWARD
            self.context.start_reduce(self)

    def reduce_accumulated_grads(self) -> None:
        """Reduce this unit's accumulated gradients now, outside autograd.

        torch.distributed.pipelining does this after its last micro-batch (sync
        back on), then calls :meth:`RootContext.complete_backward` on the stage's root.
        """
        group = self.group
        if group is not None and group.reducer.reduce_grads:
            self.phase = TrainingPhase.POST_BACKWARD
            (self.context or self._lazy_init_as_root()).start_reduce(self)


def _cast_floats(tree: Any, dtype: torch.dtype) -> Any:
    return map_tensors(lambda x: x.to(dtype) if x.is_floating_point() and x.dtype != dtype else x, tree)
