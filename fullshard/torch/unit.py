"""One unit on torch: the module hooks that drive its lifecycle (``fullshard.core.unit``), its root's, and the
``FSDPModule`` class a sharded module becomes: FSDP2's class, with the methods every runtime shares
(``fullshard.core.module``) and what torch has alone (gradient hooks on streams, custom collectives,
post-optimizer events, ``_apply``).

Where torch tells a unit where it is in a step:

* forward pre-hook: the root's forward begins a step; gather (``Unit.pre_forward``); put an identity node on
  the inputs that need a gradient, whose backward is the unit's post-backward;
* forward hook: ``Unit.post_forward`` (keep or reshard); hook the outputs, so that backward reaching them
  gathers again (``Unit.pre_backward``);
* the inputs' identity node: autograd has computed every gradient this forward gives the unit, and summed it
  before it runs that node (AccumulateGrad runs first), so ``Unit.post_backward`` reduces here. No count of
  gradient arrivals can know this: a parameter used by two reentrant checkpoint segments receives two;
* autograd's queued callback: ``Root.end_of_backward``.

A forward inside backward is activation checkpointing recomputing a unit: it belongs to the step already
running, so it never becomes a root.
"""
from __future__ import annotations

import threading
import warnings
import weakref
from types import SimpleNamespace
from typing import Any, Callable, Iterable, Iterator, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed import fsdp as torch_fsdp
from torch.autograd import Variable
from torch.autograd.graph import register_multi_grad_hook
from torch.distributed.tensor import DTensor
from torch.profiler import record_function

from fullshard.core import module as core_module
from fullshard.core.checks import Ranks, check_ranks_agree, describe_model
from fullshard.core.module import FSDPModuleMethods
from fullshard.core.trees import leaves_in, map_leaves
from fullshard.core.unit import UNIT_ATTR, Root, TrainingPhase, Unit, named_under
from fullshard.plan.group import Strategy
from fullshard.torch import checks, finalize
from fullshard.torch.collectives import ranks_summing_over
from fullshard.torch.errors import DeepcopyError
from fullshard.torch.finalize import FinalizationMethods
from fullshard.torch.group import ParamGroup
from fullshard.torch.policies import (
    TORCH_PROMOTES_REDUCE_DTYPE, MixedPrecisionPolicy, capture_grad_dtype_policy, restore_explicit_grad,
    show_grad_dtype_policy, take_explicit_grad,
)

_active = threading.local()
# torch's own class, taken once at import (see api.py's policy classes for why not at call time).
_TORCH_FSDP_MODULE = torch_fsdp.FSDPModule


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


class StepRoot(Root):
    def __init__(self, root: "ShardedUnit") -> None:
        super().__init__(root)
        self.post_optim_event: Any = None  # FSDPModule.set_post_optim_event
        # set_manual_backward_finalization as latched when a backward started (None: none since the last end of
        # a step). The handle of an asynchronous finalize_backward not yet waited on is the root unit's
        # communication context's (finalize.py), which roots may share.
        self.manual_active: Optional[bool] = None

    def _queue_end_of_backward(self) -> None:
        if self.manual_active is None:
            self.manual_active = self.unit.manual_finalization
        Variable._execution_engine.queue_callback(self._backward_done)

    def _backward_done(self) -> None:
        if self.manual_active:
            finalize.defer_end_of_backward(self)  # the caller ends the step: FSDPModule.finalize_backward
        else:
            self.manual_active = None
            self.end_of_backward()

    def check_not_in_backward(self, what: str) -> None:
        if self.unit._comm_ctx.active_reduction is not None:  # this root's or another's sharing the context
            raise RuntimeError("The previous gradient reduction must be waited on before forward")
        super().check_not_in_backward(what)

    def reset_step(self) -> None:
        context = self.unit._comm_ctx
        if context.active_reduction is not None and context.active_reduction.root is not self:
            raise RuntimeError("reset_iter_state cannot reset a gradient reduction owned by another FSDP root "
                               "sharing the communication context")
        # an outstanding handle's wait() raises from now on
        self.manual_active = context.active_reduction = None
        super().reset_step()

    def _before_gathers(self) -> None:
        if self.post_optim_event is not None:
            self.post_optim_event.wait()  # the gathers that follow run on the current stream
            self.post_optim_event = None

    def _after_reductions(self) -> None:
        offloaded = [g for g in self.groups if g.offloaded_to_host]
        if offloaded:
            # gradients copied to pinned host memory without blocking: done before the optimizer reads them
            getattr(torch, offloaded[0].params[0].device.type).synchronize()

    def _after_backward(self) -> None:
        if checks.finite and self.groups:
            checks.raise_if_any(self.groups[0].process_group)

    def check_ranks_agree(self, units: list) -> None:
        """Every rank of the model compares the settings of ``units`` (``fullshard.core.checks``)."""
        if any(unit.manual_finalization for unit in units if unit is not self.unit):
            raise RuntimeError("set_manual_backward_finalization must be called on the root FSDP module")
        groups = [group for unit in units for group in unit.groups]
        if not groups:
            return
        for group in groups:  # parameters frozen or replaced since fully_shard are compared as they are now
            group.follow_replaced_params()
        rows = describe_model(units, _unit_values, _group_values, _param_values)
        check_ranks_agree(
            rows, _model_ranks(groups),
            "every rank must build the same model, apply fully_shard the same way and set FULLSHARD_EXCHANGE alike "
            "(or nowhere)",
        )


def _unit_values(unit: "ShardedUnit") -> dict[str, Any]:
    return {"main_dtype": unit.mp_policy.main_dtype}


def _group_values(group: ParamGroup) -> dict[str, Any]:
    meshes = {id(p.mesh): p.mesh for p in group.params}.values()  # with tensor parallelism, two
    block = group.post_forward_group  # reshard_after_forward=k: backward gathers within blocks of k ranks
    return {
        "mesh": "; ".join(_mesh_text(mesh) for mesh in meshes),
        "exchange": f"all-gather {group.plan.collectives.gather.value}, reduce-scatter {group.plan.collectives.reduce.value}",
        "fuse_below_numel": group.plan.fuse_below_numel,
        "reshard_after_forward block": dist.get_world_size(block) if block is not None else None,
    }


def _mesh_text(mesh: Any) -> str:
    """The whole mesh and, for a sub-mesh (``mesh["dp"]``), which of its dims: a sub-mesh's own ranks are this
    rank's row only, which the other rows' ranks hold differently."""
    root = mesh._get_root_mesh()
    names = f" {root.mesh_dim_names}" if root.mesh_dim_names else ""
    dims = f", dims {mesh.mesh_dim_names}" if root is not mesh else ""
    return f"{root.device_type} {tuple(root.shape)}{names} of ranks {root.mesh.tolist()}{dims}"


def _param_values(param: Any) -> dict[str, Any]:
    # the global shape: a tensor-parallel local shape may differ between the tp ranks
    return {"shape": tuple(param.spec.shape), "placements": param.placements, "all-gather extension": param.extended}


def _model_ranks(groups: list[ParamGroup]) -> Ranks:
    """Every rank of the widest mesh the parameters are placed on (with tensor parallelism, the tp dim too).

    A mesh of the whole world sums on the default group, whose identity no setting can change: ranks that
    disagree on the mesh itself still meet there. A mesh of fewer ranks (a pipeline stage's) sums along each
    of its dims in turn, which adds up every rank of it; the ranks outside run other models, and a sum over
    the world would wait for them.
    """
    mesh = max((p.mesh for g in groups for p in g.params), key=lambda m: m.size())
    whole = mesh.size() == dist.get_world_size()
    return ranks_summing_over([None] if whole else [mesh.get_group(d) for d in range(mesh.ndim) if mesh.size(d) > 1],
                              groups[0].params[0].device)


class ShardedUnit(Unit):
    root_class, active = StepRoot, _active
    manual_finalization = False  # FSDPModule.set_manual_backward_finalization (the root's counts)

    def __init__(
        self,
        modules: list[nn.Module],
        groups: list[ParamGroup],  # one per mesh the call's parameters are on (expert parallelism: several)
        mp_policy: MixedPrecisionPolicy,
        reshard_after_forward: Optional[bool],
        strategy: Strategy,
    ) -> None:
        super().__init__(groups, strategy, reshard_after_forward, len(modules))
        self.modules = modules
        self.mp_policy = mp_policy
        self._comm_ctx = SimpleNamespace(active_reduction=None)  # FSDP2's name, read by pipelining: finalize.py
        for group in groups:
            group.on_grad = self._on_grad
        for module in modules:
            module.register_state_dict_pre_hook(self._before_state_dict)
            module.register_load_state_dict_pre_hook(self._before_load_state_dict)
            # Only torches with gradient dtype policies have one to restore. Elsewhere the hook is pure cost: with it
            # registered, `fullshard bench --configs zero3-fp32 zero2-fp32` measured 6.7 MiB more held at ZeRO-2's step.
            if TORCH_PROMOTES_REDUCE_DTYPE:
                module.register_load_state_dict_post_hook(self._after_load_state_dict)
            # torch.compile traces the module's own forward and leaves the hooks to run eagerly
            # (a graph break at each unit's edges): they issue collectives, wait on them and swap
            # registered parameters, none of which belongs in a traced graph.
            module.register_forward_pre_hook(torch.compiler.disable(self._pre_forward), prepend=True, with_kwargs=True)
            # always_call: a forward that raises still restores the root marker
            module.register_forward_hook(torch.compiler.disable(self._post_forward), prepend=False, always_call=True)

    @property
    def group(self) -> Optional[ParamGroup]:
        return self.groups[0] if self.groups else None

    @property
    def name(self) -> str:
        return self.group.module_name if self.group is not None else type(self.modules[0]).__name__

    def _profile(self, label: str) -> Any:
        return record_function(label)

    def _named_submodules(self) -> Iterator[tuple[str, nn.Module]]:
        return named_under(self.modules, nn.Module.named_modules)

    # ------------------------------------------------------------------ state dict
    def _before_state_dict(self, *_args: Any) -> None:
        """state_dict() returns the shards (FSDP2 does the same). The tensors it returns may be written
        (dcp.load writes into them, below any version counter): a kept copy is gathered again."""
        for group in self.groups if not _in_backward() else ():
            if group.shows_unsharded:
                group.mark_stale()

    def _before_load_state_dict(self, module: nn.Module, state_dict: dict, prefix: str, *_args: Any) -> None:
        """Load into the shards, accepting full (plain) tensors for sharded parameters: keep this rank's
        shard of each. A kept unsharded copy is gathered again at the next forward."""
        self._before_state_dict()
        paths = {id(m): name for name, m in module.named_modules()}
        for param in (param for group in self.groups for param in group.params):
            for owner, attr in param.owners:
                if id(owner) not in paths:
                    continue
                key = f"{prefix}{paths[id(owner)]}.{attr}" if paths[id(owner)] else f"{prefix}{attr}"
                value = state_dict.get(key)
                if isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and value.shape == param.spec.shape:
                    state_dict[key] = param.full_to_sharded(value)

    def _after_load_state_dict(self, *_args: Any) -> None:
        """FSDP2 2.15: parameters load_state_dict(assign=True) put in have no ``Tensor.grad_dtype``; they show the
        policy at once (an explicit one they bring is adopted)."""
        for group in self.groups:
            if any([capture_grad_dtype_policy(param) for param in group.params]):
                group.replan()
            for param in group.params:
                show_grad_dtype_policy(param)

    # ------------------------------------------------------------------ forward
    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        in_backward = _in_backward()
        if in_backward and self.phase is TrainingPhase.PRE_BACKWARD:
            self.gather_for_recomputation()
            return self._cast_inputs(args, kwargs)
        if self.root is not None and not in_backward:
            self.root.check_not_in_backward(type(module).__name__)
        if not in_backward and self.enter_root_forward():
            groups = self.root.groups
            if checks.inputs and groups:
                checks.check_same_input_shapes(args, kwargs, type(module).__name__, groups[0].process_group)
        first_in_pass = self.phase is not TrainingPhase.FORWARD  # fully_shard([a, b]): once per pass
        self.pre_forward(prefetch=not in_backward)
        if self.group is not None and first_in_pass and torch.is_grad_enabled():
            args, kwargs = self._register_post_backward((args, kwargs))
        return self._cast_inputs(args, kwargs)

    def _register_post_backward(self, inputs: Any) -> Any:
        tensors = [t for t in leaves_in(inputs, torch.Tensor) if t.requires_grad]
        if not tensors:
            return inputs  # no backward reaches the inputs: the root's end of backward reduces this unit
        passed_through = _PostBackward.apply(weakref.ref(self), *tensors)
        replacement = {id(t): out for t, out in zip(tensors, passed_through)}
        return map_leaves(lambda t: replacement.get(id(t), t), inputs, torch.Tensor)

    def _cast_inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        dtype = self.mp_policy.param_dtype
        if dtype is None or not self.mp_policy.cast_forward_inputs:
            return args, kwargs
        return _cast_floats((args, kwargs), dtype)

    def _post_forward(self, module: nn.Module, args: tuple, output: Any) -> Any:
        in_backward = _in_backward()
        if not (in_backward and self.phase is TrainingPhase.PRE_BACKWARD) and self.group is not None:
            # Outputs that need a gradient: a backward will come through this unit.
            needs_grad = torch.is_grad_enabled() and self._hook_outputs_for_backward(output)
            self.post_forward(module, needs_grad, in_backward)
        if self.mp_policy.output_dtype is not None:
            output = _cast_floats(output, self.mp_policy.output_dtype)
        self.leave_root_forward()
        return output

    def _hook_outputs_for_backward(self, output: Any) -> bool:
        """Gather this unit again when backward reaches its outputs; False if none needs a gradient."""
        tensors = [t for t in leaves_in(output, torch.Tensor) if t.requires_grad]
        if tensors:
            # Autograd keeps the hook in C++, out of reach of Python's cycle collector: a strong
            # reference to this state would keep the whole model alive once it is dropped.
            state_ref = weakref.ref(self)

            def pre_backward(grad: Any) -> None:
                state = state_ref()
                if state is not None:
                    state.pre_backward()

            register_multi_grad_hook(tensors, pre_backward, mode="any")
        return bool(tensors)

    def _on_grad(self) -> None:
        self.root.queue_end_of_backward()


def _cast_floats(tree: Any, dtype: torch.dtype) -> Any:
    return map_leaves(lambda x: x.to(dtype) if x.is_floating_point() and x.dtype != dtype else x, tree, torch.Tensor)


# ------------------------------------------------------------------------ the class a sharded module becomes
# The dynamic subclass fully_shard gives each module class: FSDP<Orig>(FSDPModule, Orig).
FSDP_CLASSES: dict[type, type] = {}


class UnshardHandle(core_module.UnshardHandle, torch_fsdp.UnshardHandle):
    """Returned by ``unshard(async_op=True)``: ``wait()`` completes the all-gather (torch's type, for
    ``isinstance``)."""


class FSDPModule(FSDPModuleMethods, FinalizationMethods, torch_fsdp.FSDPModule):
    """Mixin added to every module ``fully_shard`` was applied to (a dynamic subclass).

    It subclasses PyTorch's ``FSDPModule`` so that code finding FSDP modules with ``isinstance`` (torchtitan,
    accelerate, Lightning, torch's pipeline schedules) finds these too; every public method is defined here
    or in ``FSDPModuleMethods``, none is inherited from torch's. PyTorch's ``__new__`` is: constructing the class
    again (slicing an ``nn.Sequential``) gives the original class, as in FSDP2.
    """

    # Where PyTorch's __new__ finds the original class in the MRO:
    # [FSDP<Orig>, this class, FSDPModuleMethods, FinalizationMethods, torch's FSDPModule, Orig, ...]
    _orig_cls_mro_index = 5
    unshard_handle = UnshardHandle

    def _modules_in_reach(self, recurse: bool) -> Iterable[nn.Module]:
        return self.modules() if recurse else [self]

    def _apply(self, *args: Any, **kwargs: Any) -> Any:
        # to_empty(), .to(), .float() ... replace sharded parameters or their data:
        # show the sharded ones first, then re-adopt what changed.
        self.reshard()
        groups = getattr(self, UNIT_ATTR).groups
        changed = [any([capture_grad_dtype_policy(p) for p in group.params]) for group in groups]
        kept = [(p, take_explicit_grad(p)) for group in groups for p in group.params]
        # Past torch's FSDPModule (its _apply needs FSDP2 state) to the original class.
        result = super(_TORCH_FSDP_MODULE, self)._apply(*args, **kwargs)
        for group, policy_changed in zip(groups, changed):
            if not group.follow_replaced_params() and policy_changed:
                group.replan()  # the parameters stayed, but what their gradients accumulate in did not
        with torch.no_grad():
            for param, grad in kept:
                if grad is not None:
                    restore_explicit_grad(param, grad)
        return result

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        super().set_reshard_after_forward(reshard_after_forward, recurse)
        self._configure(recurse, post_forward_group=None)  # a reshard_after_forward=k block goes with it

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Deprecated in FSDP2 in favour of :meth:`set_gradient_divide_factor`, which it calls."""
        warnings.warn(
            "set_reduce_scatter_divide_factor is deprecated; use set_gradient_divide_factor", FutureWarning,
            stacklevel=2,
        )
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Accepted for FSDP2 compatibility: fullshard's collectives always sum, and divide afterwards."""
        if not isinstance(enable, bool):
            raise ValueError(f"set_force_sum_reduction_for_comms expects a bool, got {type(enable).__name__}")

    def set_all_reduce_hook(self, hook: Callable[[torch.Tensor], None], *, stream: Any = None) -> None:
        """Call ``hook(reduced)`` on each reduced gradient bucket of this module's group, in place,
        before the division by the world size (after the replica all-reduce under HSDP): e.g. to
        all-reduce across replicas fullshard does not know of. ``stream``: run it there (the current
        stream then waits for it); not with HSDP, whose own all-reduce runs where the hook would."""
        if not callable(hook):
            raise ValueError(f"set_all_reduce_hook expects a callable, got {type(hook).__name__}")
        groups = getattr(self, UNIT_ATTR).groups  # every mesh's (FSDP2 refuses several; each runs it on its own)
        if stream is not None and any(group.replicate_group is not None for group in groups):
            raise ValueError("stream cannot be set when using native HSDP")  # FSDP2's words, exactly
        self._configure(False, all_reduce_hook=hook, all_reduce_hook_stream=stream)

    def set_post_optim_event(self, event: Any) -> None:
        """Make the next forward's all-gathers wait for ``event`` (recorded after the optimizer step).

        fullshard gathers on the current stream, so this is only needed when the
        optimizer ran on another stream; the event is used once, then dropped.
        """
        unit = getattr(self, UNIT_ATTR)
        (unit.root or unit.lazy_init_as_root()).post_optim_event = event

    def _ignored_hint(self, method: str) -> None:
        warnings.warn(
            f"{method} is a tuning hint for FSDP2's own buffers and streams; fullshard plans its "
            "buffers and exchange itself and ignores it", UserWarning, stacklevel=3,
        )

    def set_allocate_memory_from_process_group_for_comm(self, *args: Any, **kwargs: Any) -> None:
        group = getattr(self, UNIT_ATTR).group
        if group is not None and (group.custom_all_gather is not None or group.custom_reduce_scatter is not None):
            raise AssertionError(
                "set_allocate_memory_from_process_group_for_comm after set_custom_all_gather / "
                "set_custom_reduce_scatter: the custom collectives allocate their own buffers"
            )
        self._ignored_hint("set_allocate_memory_from_process_group_for_comm")

    def set_symm_mem_for_comm(self, *args: Any, **kwargs: Any) -> None:
        self._ignored_hint("set_symm_mem_for_comm")

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *args: Any, **kwargs: Any) -> None:
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise TypeError(f"set_reduce_scatter_max_input_buffers expects an int, got {max_input_buffers!r}")
        if max_input_buffers < 1:
            raise ValueError(f"set_reduce_scatter_max_input_buffers expects at least 1, got {max_input_buffers}")
        self._ignored_hint("set_reduce_scatter_max_input_buffers")

    def _set_unshard_async_op(self, *args: Any, **kwargs: Any) -> None:
        self._ignored_hint("_set_unshard_async_op")

    def set_custom_all_gather(self, comm: Any) -> None:
        """Gather this module's parameters with ``comm`` (FSDP2's ``AllGather``: ``allocate(size, dtype=,
        device=)`` and ``comm(output, input, group, async_op)``). fullshard packs this rank's chunk into the
        buffer ``comm.allocate`` gives, copies the parameters out, and drops that buffer (never resizes it)."""
        self._set_custom_comm("custom_all_gather", comm)

    def set_custom_reduce_scatter(self, comm: Any) -> None:
        """Reduce this module's gradients with ``comm`` (FSDP2's ``ReduceScatter``: ``allocate`` and
        ``comm(output, input, group, op, async_op)``), its input packed in a buffer of ``comm.allocate``."""
        self._set_custom_comm("custom_reduce_scatter", comm)

    def _set_custom_comm(self, attribute: str, comm: Any) -> None:
        if comm is not None and not (callable(comm) and callable(getattr(comm, "allocate", None))):
            raise ValueError(f"{attribute}: expects an object with allocate() that can be called, got {comm!r}")
        for group in getattr(self, UNIT_ATTR).groups:  # each mesh's group calls it on its own process group
            setattr(group, attribute, comm)
            group.replan()

    def set_separate_reduce_scatter_group(self, enable: bool, *args: Any, **kwargs: Any) -> None:
        if enable:
            raise NotImplementedError(
                f"{type(self).__name__}.set_separate_reduce_scatter_group: fullshard reduces on the group it "
                "gathers on; drop the call"
            )

    def __deepcopy__(self, memo: dict) -> Any:
        raise DeepcopyError(
            f"FSDP does not support deepcopy. copy.deepcopy of a sharded {type(self).__name__} is not supported: its "
            "parameters are shards bound to process groups. Deepcopy the model before fully_shard, or "
            "build a new one and load a state dict into it."
        )

    def _get_fsdp_state(self) -> Any:
        """fullshard's state, whose ``_pre_forward``/``_post_forward`` take FSDP2's arguments: torch's own
        ``register_fsdp_forward_method`` works on fullshard modules. Nothing else of FSDP2's state exists."""
        return getattr(self, UNIT_ATTR)


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Make ``module.<method_name>`` (e.g. ``generate``) gather and free parameters like ``forward``.

    Only ``forward`` runs through module hooks; other methods that use the
    parameters need this (FSDP2 has the same function).
    """
    unit: ShardedUnit = getattr(module, UNIT_ATTR, None)
    if unit is None:
        return  # as in FSDP2: a no-op for a module that is not sharded, so the same code runs without fullshard
    if not callable(getattr(module, method_name, None)):
        raise ValueError(f"register_fsdp_forward_method: {type(module).__name__} has no method '{method_name}'")
    method = getattr(module, method_name)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = unit._pre_forward(module, args, kwargs)
        return unit._post_forward(module, args, method(*args, **kwargs))

    setattr(module, method_name, wrapped)


