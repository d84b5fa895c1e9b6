"""The public entry point: ``fully_shard`` and the ``FSDPModule`` methods (FSDP2-compatible)."""
from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable, Iterator, Optional, Union

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed import fsdp as torch_fsdp
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from fullshard.plan import ShardLayout
from fullshard.plan.strategy import Strategy, lifecycle
from fullshard.torch.policies import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    as_mp_policy,
    as_offload_policy,
)
from fullshard.torch import fsdp2_views
from fullshard.torch.group import ParamGroup
from fullshard.torch.param import ShardedParam
from fullshard.torch.state import ShardState

# Parameters already taken over by some fully_shard call (the originals and
# their sharded replacements) carry this attribute: a parameter shared with a
# module outside that call would otherwise be sharded twice and silently
# untied. (An attribute, not a weak reference: torch refuses to swap tensors
# that have weak references, as module._apply does for DTensors.)
_MANAGED_ATTR = "_fullshard_managed"


def _is_managed(param: nn.Parameter) -> bool:
    return getattr(param, _MANAGED_ATTR, False)


def _mark_managed(param: nn.Parameter) -> None:
    setattr(param, _MANAGED_ATTR, True)


_FSDP_CLASSES: dict[type, type] = {}


class UnshardHandle(torch_fsdp.UnshardHandle):
    """Returned by ``unshard(async_op=True)``: ``wait()`` completes the all-gather."""

    def __init__(self, state: Optional[ShardState]) -> None:
        self._state = state

    def wait(self) -> None:
        if self._state is not None and self._state.group is not None:
            self._state.group.wait_for_unshard()
            self._state.group.register_unsharded()
        self._state = None


class FSDPModule(torch_fsdp.FSDPModule):
    """Mixin added to every module ``fully_shard`` was applied to (a dynamic subclass).

    It subclasses PyTorch's ``FSDPModule`` so that code finding FSDP modules
    with ``isinstance`` (torchtitan, accelerate, Lightning, torch's pipeline
    schedules) finds these too; every public method is defined here, none is
    inherited. PyTorch's ``__new__`` is: constructing the class again (slicing
    an ``nn.Sequential``) gives the original class, as in FSDP2.
    """

    # Where PyTorch's __new__ finds the original class in the MRO:
    # [FSDP<Orig>, this class, torch's FSDPModule, Orig, ...]
    _orig_cls_mro_index = 3

    def _fullshard_states(self, recurse: bool) -> list[ShardState]:
        modules = self.modules() if recurse else [self]
        seen, states = set(), []
        for module in modules:
            state = getattr(module, "_fullshard_state", None)
            if state is not None and id(state) not in seen:
                seen.add(id(state))
                states.append(state)
        return states

    def unshard(self, async_op: bool = False) -> Optional[UnshardHandle]:
        """All-gather this module's parameters now (e.g. to prefetch); they stay until ``reshard()``."""
        state = self._fullshard_state
        if state.group is not None:
            state.group.unshard()
        handle = UnshardHandle(state)
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        """Free the unsharded parameters and show the sharded ones again."""
        state = self._fullshard_state
        if state.group is not None:
            state.group.reshard()
            state.group.register_sharded()

    def _apply(self, *args: Any, **kwargs: Any) -> Any:
        # to_empty(), .to(), .float() ... replace sharded parameters or their data:
        # show the sharded ones first, then re-adopt what changed.
        self.reshard()
        # Past torch's FSDPModule (its _apply needs FSDP2 state) to the original class.
        result = super(torch_fsdp.FSDPModule, self)._apply(*args, **kwargs)
        group = self._fullshard_state.group
        if group is not None:
            group.refresh_sharded()
        return result

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """False: keep accumulating unsharded gradients locally, no communication (FSDP1's ``no_sync``)."""
        for state in self._fullshard_states(recurse):
            if state.group is not None:
                state.group.reduce_grads = requires_gradient_sync
                state.group.all_reduce_grads = requires_gradient_sync

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Context manager form of ``set_requires_gradient_sync(False)``."""
        self.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.set_requires_gradient_sync(True)

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: False keeps reduce-scattered partial sums (owned) and skips the replica all-reduce
        until a backward with True. No effect on a 1-D mesh, which has no replicas."""
        for state in self._fullshard_states(recurse):
            if state.group is not None:
                state.group.all_reduce_grads = requires_all_reduce

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(f"reshard_after_forward must be a bool, got {type(reshard_after_forward).__name__}")
        for state in self._fullshard_states(recurse):
            state.reshard_after_forward = reshard_after_forward
            if state.group is not None:
                state.group.post_forward_group = None

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        for state in self._fullshard_states(recurse):
            if state.group is not None:
                state.group.reshard_after_backward = reshard_after_backward

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Accepted for FSDP2 compatibility; nothing to do: every backward already waits for its
        reductions and keeps no prefetch state across backward passes."""

    def set_modules_to_forward_prefetch(self, modules: list["FSDPModule"]) -> None:
        """Start these modules' all-gathers right after this module's, in forward."""
        self._fullshard_state.forward_prefetch = [_state_of(m, "set_modules_to_forward_prefetch") for m in modules]

    def set_modules_to_backward_prefetch(self, modules: list["FSDPModule"]) -> None:
        """Start these modules' all-gathers right after this module's, in backward."""
        self._fullshard_state.backward_prefetch = [_state_of(m, "set_modules_to_backward_prefetch") for m in modules]

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide reduced gradients by ``factor`` instead of the world size (1.0 gives a sum)."""
        if not factor > 0:
            raise ValueError(f"gradient divide factor must be > 0, got {factor}")
        for state in self._fullshard_states(recurse=True):
            if state.group is not None:
                state.group.divide_factor = float(factor)

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

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """False: do not all-gather this module's parameters for backward, because no backward
        op reads them (e.g. an embedding, whose weight gradient needs only the indices)."""
        state = self._fullshard_state
        if state.group is not None:
            state.group.unshard_in_backward = bool(unshard_in_backward)

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *, recurse: bool = True) -> None:
        """True: reduce a zero gradient for every parameter that got none in a backward.

        Needed when ranks use different parameters in a step (conditional
        branches, mixture of experts): every rank must take part in each
        reduction. Each such unit that ran forward with grad enabled reduces at
        the end of backward, in module order on every rank (holding its
        unsharded parameters and gradients until then), and its parameters get
        a gradient (zero where no rank had one).
        """
        for state in self._fullshard_states(recurse):
            if state.group is not None:
                state.group.reduce_unused_params = bool(reduce_scatter_unused_params)

    def set_all_reduce_hook(self, hook: Callable[[torch.Tensor], None], *, stream: Any = None) -> None:
        """Call ``hook(reduced)`` on each reduced gradient bucket of this module's group, in place,
        before the division by the world size (after the replica all-reduce under HSDP): e.g. to
        all-reduce across replicas fullshard does not know of. ``stream`` must be None: fullshard
        reduces on the current stream."""
        if stream is not None:
            raise ValueError("set_all_reduce_hook: fullshard runs the hook on the current stream; pass stream=None")
        if not callable(hook):
            raise ValueError(f"set_all_reduce_hook expects a callable, got {type(hook).__name__}")
        state = self._fullshard_state
        if state.group is not None:
            state.group.all_reduce_hook = hook

    def set_post_optim_event(self, event: Any) -> None:
        """Make the next forward's all-gathers wait for ``event`` (recorded after the optimizer step).

        fullshard gathers on the current stream, so this is only needed when the
        optimizer ran on another stream; the event is used once, then dropped.
        """
        (self._fullshard_state.root or self._fullshard_state).post_optim_event = event

    def reset_iter_state(self) -> None:
        """After a forward or backward raised: drop this step's pending reductions and gradients
        in flight, reshard every unit, so the next step starts clean (call on the root)."""
        self._fullshard_state.reset_step()

    def _ignored_hint(self, method: str) -> None:
        warnings.warn(
            f"{method} is a tuning hint for FSDP2's own buffers and streams; fullshard plans its "
            "buffers and exchange itself and ignores it", UserWarning, stacklevel=3,
        )

    def set_allocate_memory_from_process_group_for_comm(self, *args: Any, **kwargs: Any) -> None:
        self._ignored_hint("set_allocate_memory_from_process_group_for_comm")

    def set_symm_mem_for_comm(self, *args: Any, **kwargs: Any) -> None:
        self._ignored_hint("set_symm_mem_for_comm")

    def set_reduce_scatter_max_input_buffers(self, *args: Any, **kwargs: Any) -> None:
        self._ignored_hint("set_reduce_scatter_max_input_buffers")

    def _set_unshard_async_op(self, *args: Any, **kwargs: Any) -> None:
        self._ignored_hint("_set_unshard_async_op")

    def _unsupported(self, method: str) -> None:
        raise NotImplementedError(
            f"{type(self).__name__}.{method}: fullshard chooses its own collectives for each bucket "
            "(see fullshard.plan.exchange) and does not take user-supplied ones; drop the call"
        )

    def set_custom_all_gather(self, comm: Any) -> None:
        self._unsupported("set_custom_all_gather")

    def set_custom_reduce_scatter(self, comm: Any) -> None:
        self._unsupported("set_custom_reduce_scatter")

    def set_separate_reduce_scatter_group(self, enable: bool, *args: Any, **kwargs: Any) -> None:
        if enable:
            self._unsupported("set_separate_reduce_scatter_group")

    def __deepcopy__(self, memo: dict) -> Any:
        raise TypeError(
            f"copy.deepcopy of a sharded {type(self).__name__} is not supported (nor by FSDP2): its "
            "parameters are shards bound to process groups. Deepcopy the model before fully_shard, or "
            "build a new one and load a state dict into it."
        )

    def _get_fsdp_state(self) -> Any:
        """fullshard's state, whose ``_pre_forward``/``_post_forward`` take FSDP2's arguments: torch's own
        ``register_fsdp_forward_method`` works on fullshard modules. Nothing else of FSDP2's state exists."""
        return self._fullshard_state


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Make ``module.<method_name>`` (e.g. ``generate``) gather and free parameters like ``forward``.

    Only ``forward`` runs through module hooks; other methods that use the
    parameters need this (FSDP2 has the same function).
    """
    if not hasattr(module, "_fullshard_state"):
        return  # as in FSDP2: a no-op for a module that is not sharded, so the same code runs without fullshard
    if not callable(getattr(module, method_name, None)):
        raise ValueError(f"register_fsdp_forward_method: {type(module).__name__} has no method '{method_name}'")
    state = module._fullshard_state
    method = getattr(module, method_name)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = state._pre_forward(module, args, kwargs)
        return state._post_forward(module, args, method(*args, **kwargs))

    setattr(module, method_name, wrapped)


def _state_of(module: Any, caller: str) -> ShardState:
    state = getattr(module, "_fullshard_state", None)
    if state is None:
        raise ValueError(f"{caller}: {type(module).__name__} is not an FSDPModule; apply fully_shard to it first")
    return state


def _default_mesh() -> DeviceMesh:
    if not dist.is_initialized():
        raise RuntimeError(
            "fully_shard: no mesh given and torch.distributed is not initialized; call "
            "torch.distributed.init_process_group (e.g. under torchrun) or pass mesh=init_device_mesh(...)"
        )
    device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    return init_device_mesh(device_type, (dist.get_world_size(),))


_POST_FORWARD_GROUPS: dict[tuple[int, ...], dist.ProcessGroup] = {}


def _post_forward_group(shard_group: dist.ProcessGroup, size: int) -> dist.ProcessGroup:
    """This rank's block of ``size`` consecutive ranks of ``shard_group`` (created once, by its members only)."""
    ranks = dist.get_process_group_ranks(shard_group)
    first = (dist.get_rank(shard_group) // size) * size
    block = tuple(ranks[first : first + size])
    if block not in _POST_FORWARD_GROUPS:
        _POST_FORWARD_GROUPS[block] = dist.new_group(list(block), use_local_synchronization=True)
    return _POST_FORWARD_GROUPS[block]


def _device_accepted(param_device: torch.device, mesh_device: torch.device) -> bool:
    """Meta and CPU parameters are accepted (CPU ones are moved, as in FSDP2); others must be on the mesh's device."""
    return param_device.type in ("meta", "cpu") or param_device == mesh_device


def _mesh_device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    module = getattr(torch, mesh.device_type)
    return torch.device(mesh.device_type, module.current_device())


def _owners_of_params(
    modules: list[nn.Module], ignored: set[int]
) -> tuple[dict[int, list[tuple[nn.Module, str, str]]], dict[int, nn.Parameter]]:
    """Every (module, attribute name, fqn) holding each managed parameter, skipping nested FSDP units."""
    owners: dict[int, list[tuple[nn.Module, str, str]]] = {}
    params: dict[int, nn.Parameter] = {}

    def visit(module: nn.Module, prefix: str, is_top: bool) -> None:
        if not is_top and hasattr(module, "_fullshard_state"):
            return
        for name, param in module._parameters.items():
            if param is None or id(param) in ignored:
                continue
            params[id(param)] = param
            owners.setdefault(id(param), []).append((module, name, prefix + name))
        for child_name, child in module._modules.items():
            if child is not None:
                visit(child, f"{prefix}{child_name}.", False)

    for index, module in enumerate(modules):
        visit(module, f"[{index}]." if len(modules) > 1 else "", True)
    return {key: owners[key] for key in params}, params


def fully_shard(
    module: Union[nn.Module, list[nn.Module]],
    *,
    mesh: Optional[DeviceMesh] = None,
    reshard_after_forward: Optional[bool] = None,
    shard_placement_fn: Optional[Callable[[nn.Parameter], Optional[Shard]]] = None,
    mp_policy: Any = MixedPrecisionPolicy(),
    offload_policy: Any = OffloadPolicy(),
    ignored_params: Optional[set[nn.Parameter]] = None,
    strategy: Union[str, Strategy] = Strategy.OPTIM_GRADS_PARAMS,
) -> Union[nn.Module, list[nn.Module]]:
    """Shard ``module``'s parameters across ``mesh`` (ZeRO-3), FSDP2-compatible.

    Parameters become ``DTensor`` shards (``Shard(0)``, or what
    ``shard_placement_fn`` returns, any dim, even or not). Around each forward
    they are all-gathered in ``mp_policy.param_dtype``; after backward their
    gradients are reduce-scattered in ``mp_policy.reduce_dtype`` and averaged.
    A list of modules forms one communication group. Returns ``module``.

    ``strategy`` (beyond FSDP2) names how much is sharded: ``"no_shard"``
    (replicate, like DDP), ``"optim"`` (ZeRO-1), ``"optim_grads"`` (ZeRO-2) or
    ``"optim_grads_params"`` (ZeRO-3, the default); see
    ``fullshard.plan.strategy`` for the flags each one sets.
    """
    modules = list(module) if isinstance(module, (list, tuple)) else [module]
    name = ", ".join(type(m).__name__ for m in modules)
    for m in modules:
        if not isinstance(m, nn.Module):
            raise TypeError(f"fully_shard expects nn.Module(s), got {type(m).__name__}")
        if isinstance(m, (nn.ModuleList, nn.ModuleDict)):
            raise ValueError(
                f"fully_shard({type(m).__name__}): a container without forward is never called, so its "
                "parameters would never be gathered; shard the modules it holds, or pass them as a list "
                "to form one group: fully_shard(list(container), ...)"
            )
        if hasattr(m, "_fullshard_state"):
            raise ValueError(
                f"fully_shard was already applied to {type(m).__name__}; apply it once per module "
                "(children first, then parents)"
            )
    try:
        strategy = Strategy.parse(strategy)
    except ValueError as error:
        raise ValueError(f"fully_shard({name}): {error}") from None
    replicated = strategy is Strategy.NO_SHARD
    mp = as_mp_policy(mp_policy, name)
    offload = as_offload_policy(offload_policy, name)
    if reshard_after_forward is not None and not isinstance(reshard_after_forward, (bool, int)):
        raise ValueError(
            f"fully_shard({name}): reshard_after_forward={reshard_after_forward!r} must be True, False, None "
            "or an int (the size of the group to reshard to after forward)"
        )
    mesh = mesh if mesh is not None else _default_mesh()
    if mesh.ndim not in (1, 2):
        raise ValueError(
            f"fully_shard({name}): mesh must be 1-D (shard) or 2-D (replicate, shard) for HSDP, "
            f"got {mesh.ndim}-D with dims {mesh.mesh_dim_names}"
        )
    if mesh.ndim == 2 and replicated:
        raise ValueError(
            f"fully_shard({name}): strategy 'no_shard' replicates over the whole mesh; pass a 1-D mesh"
        )
    device = _mesh_device(mesh)
    pin_memory = offload.pin_memory if isinstance(offload, CPUOffloadPolicy) else None
    # The last mesh dim shards; a leading dim (HSDP) replicates and all-reduces gradients.
    shard_dim = mesh.ndim - 1
    rank, world = mesh.get_local_rank(shard_dim), mesh.size(shard_dim)
    post_forward_size = None
    if isinstance(reshard_after_forward, int) and not isinstance(reshard_after_forward, bool):
        size = reshard_after_forward
        if size < 1 or world % size:
            raise ValueError(
                f"fully_shard({name}): reshard_after_forward={size} must divide the shard world size {world} "
                f"(e.g. the ranks of one node); use True to reshard fully"
            )
        reshard_after_forward = size != 1  # size == world: plain resharding; 1: keep unsharded
        post_forward_size = size if 1 < size < world else None

    ignored = {id(p) for p in (ignored_params or ())}
    all_params = {id(p) for m in modules for p in m.parameters()}
    strangers = [p for p in (ignored_params or ()) if id(p) not in all_params]
    if strangers:
        raise ValueError(
            f"fully_shard({name}): {len(strangers)} of ignored_params (shape {tuple(strangers[0].shape)}, ...) "
            "are not parameters of the module(s); pass only parameters of the module being sharded"
        )
    owners, params = _owners_of_params(modules, ignored)
    plans = []
    for key, param in params.items():
        fqn = owners[key][0][2]
        if isinstance(param, DTensor) and _is_managed(param):
            raise ValueError(
                f"fully_shard({name}): parameter '{fqn}' is already sharded by fully_shard on a parent "
                "module; apply fully_shard to children first, then to their parents"
            )
        if _is_managed(param):
            raise ValueError(
                f"fully_shard({name}): parameter '{fqn}' is shared with a module that fully_shard was "
                "already applied to; tied parameters must belong to one unit: apply fully_shard to "
                "their common parent only"
            )
        if not _device_accepted(param.device, device):
            raise ValueError(
                f"fully_shard({name}): parameter '{fqn}' is on {param.device} but the mesh uses {device}; "
                f"move the module to {device} (or to the CPU or meta device, which fully_shard moves) first"
            )
        placement = shard_placement_fn(param) if shard_placement_fn is not None else None
        if placement is None:
            placement = Shard(0)
        if not isinstance(placement, Shard):
            raise ValueError(
                f"fully_shard({name}): shard_placement_fn returned {placement!r} for '{fqn}'; "
                "it must return Shard(dim) or None"
            )
        if param.dim() == 0:
            raise ValueError(
                f"fully_shard({name}): parameter '{fqn}' is a scalar and cannot be sharded; "
                "pass it in ignored_params or give it shape (1,)"
            )
        dim = placement.dim + param.dim() if placement.dim < 0 else placement.dim
        if not 0 <= dim < param.dim():
            raise ValueError(
                f"fully_shard({name}): shard_placement_fn returned Shard({placement.dim}) for '{fqn}' of "
                f"shape {tuple(param.shape)}; the dim must be in [-{param.dim()}, {param.dim() - 1}]"
            )
        plans.append((param, fqn, ShardLayout(tuple(param.shape), dim, 1 if replicated else world)))

    # Everything is validated: from here on the modules are changed.
    for m in modules:
        for buffer_name, buffer in m.named_buffers():
            if buffer.device != device and buffer.device.type != "meta":
                m.get_submodule(buffer_name.rpartition(".")[0])._buffers[buffer_name.rpartition(".")[2]] = buffer.to(device)
    sharded = []
    for param, fqn, layout in plans:
        holders = [(owner, attr) for owner, attr, _ in owners[id(param)]]
        sharded.append(
            ShardedParam(
                param, holders, fqn, layout, mesh, rank, device, mp.param_dtype, replicated, pin_memory, mp.main_dtype
            )
        )
        _mark_managed(param)
        _mark_managed(sharded[-1].sharded)
    flags = lifecycle(strategy, is_root=False, reshard_after_forward=reshard_after_forward)
    group = None
    if sharded:
        group = ParamGroup(
            sharded, mesh.get_group(shard_dim), mp.reduce_dtype, name,
            replicate_group=mesh.get_group(0) if mesh.ndim == 2 else None,
            all_reduce=flags.all_reduce, reshard_after_backward=flags.reshard_after_backward,
        )
        if post_forward_size is not None:
            group.post_forward_group = _post_forward_group(mesh.get_group(shard_dim), post_forward_size)
    state = ShardState(modules, group, mp, reshard_after_forward, strategy)
    for m in modules:
        m._fullshard_state = state
        fsdp2_views.expose(m, state)
        cls = type(m)
        if cls not in _FSDP_CLASSES:
            _FSDP_CLASSES[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
        m.__class__ = _FSDP_CLASSES[cls]
    return module
