"""The public entry point: ``fully_shard`` (FSDP2-compatible), which validates everything before it
changes anything, then turns each module into an ``FSDPModule`` (``module.py``)."""
from __future__ import annotations

from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from fullshard.core.units import STATE_ATTR, owners_of_params
from fullshard.plan import ShardLayout
from fullshard.plan.strategy import AfterBackward, Strategy, lifecycle
from fullshard.torch.policies import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    as_mp_policy,
    as_offload_policy,
)
from fullshard.torch import fsdp2_views
from fullshard.torch.errors import AppliedTwiceError, ShardDimError
from fullshard.torch.group import ParamGroup
from fullshard.torch.module import FSDP_CLASSES, FSDPModule, UnshardHandle, register_fsdp_forward_method  # noqa: F401
from fullshard.torch.param import ShardedParam
from fullshard.torch.spmd import data_parallel_mesh, sharded_spec
from fullshard.torch.unit import ShardedUnit

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


def _default_mesh() -> DeviceMesh:
    if not dist.is_initialized():
        raise RuntimeError(
            "fully_shard: no mesh given and torch.distributed is not initialized; call "
            "torch.distributed.init_process_group (e.g. under torchrun) or pass mesh=init_device_mesh(...)"
        )
    device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    return init_device_mesh(device_type, (dist.get_world_size(),))


_POST_FORWARD_MESHES: dict[tuple, DeviceMesh] = {}


def _post_forward_group(mesh: DeviceMesh, shard_dim: int, size: int) -> dist.ProcessGroup:
    """This rank's block of ``size`` consecutive ranks of its shard group, where backward gathers.

    The groups of every block are made at once, by every rank of the whole
    (root) mesh, as a DeviceMesh of blocks makes them: the shard dim moved
    last, every other dim (HSDP replicas, tensor parallelism) folded into the
    rows. A group made by its members only (``use_local_synchronization``) is
    not supported by every process group (torch's threaded test group fails in
    it, then hangs), and one made from the data-parallel sub-mesh alone would
    leave out the other tensor-parallel ranks' blocks.
    """
    root = mesh._get_root_mesh()
    index = shard_dim if root is mesh else root.mesh_dim_names.index(mesh.mesh_dim_names[shard_dim])
    blocks = root.mesh.movedim(index, -1).reshape(-1, size)
    # per process group world: ranks that are threads of one process (torch's threaded test group) each
    # have their own, and a mesh's groups resolve only in the world that made them
    key = (id(dist.distributed_c10d._get_default_group()), mesh.device_type, tuple(blocks.flatten().tolist()), size)
    if key not in _POST_FORWARD_MESHES:
        _POST_FORWARD_MESHES[key] = DeviceMesh(mesh.device_type, blocks)
    return _POST_FORWARD_MESHES[key].get_group(1)


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
    return owners_of_params(modules, lambda m: m._parameters.items(), lambda m: m._modules.items(), frozenset(ignored))


def fully_shard(
    module: Union[nn.Module, list[nn.Module]],
    *,
    mesh: Optional[DeviceMesh] = None,
    reshard_after_forward: Optional[bool] = None,
    shard_placement_fn: Optional[Callable[[nn.Parameter], Optional[Shard]]] = None,
    mp_policy: Any = MixedPrecisionPolicy(),
    offload_policy: Any = OffloadPolicy(),
    ignored_params: Optional[set[nn.Parameter]] = None,
    dp_mesh_dims: Any = None,
    strategy: Union[str, Strategy] = Strategy.OPTIM_GRADS_PARAMS,
) -> Union[nn.Module, list[nn.Module]]:
    """Shard ``module``'s parameters across ``mesh`` (ZeRO-3), FSDP2-compatible.

    Parameters become ``DTensor`` shards (``Shard(0)``, or what
    ``shard_placement_fn`` returns, any dim, even or not). Around each forward
    they are all-gathered in ``mp_policy.param_dtype``; after backward their
    gradients are reduce-scattered in ``mp_policy.reduce_dtype`` and averaged.
    A list of modules forms one communication group. Returns ``module``.

    Parameters that are DTensors already (tensor parallelism) are sharded
    further across ``mesh``'s data-parallel dims; with ``dp_mesh_dims``,
    ``mesh`` is the whole SPMD mesh and names which of its dims those are
    (see ``fullshard.torch.spmd``).

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
                f"fully_shard does not support containers that do not implement forward: {type(m).__name__} is "
                "never called, so its parameters would never be gathered; shard the modules it holds, or pass "
                "them as a list to form one group: fully_shard(list(container), ...)"
            )
        if hasattr(m, STATE_ATTR):
            raise AppliedTwiceError(
                f"Each distinct composable distributed API can only be applied to a module once. fully_shard was "
                f"already applied to {type(m).__name__}; apply it once per module (children first, then parents)"
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
    # The last mesh dim shards; a leading dim (HSDP) replicates and all-reduces gradients.
    dp = data_parallel_mesh(mesh, dp_mesh_dims, name)
    if dp.shard_dim is None:  # dp_mesh_dims(replicate=...) only: replicas, as with no_shard
        strategy, replicated = Strategy.NO_SHARD, True
    elif replicated and dp.replicate_dim is not None:
        raise ValueError(
            f"fully_shard({name}): strategy 'no_shard' replicates over the whole mesh; pass a 1-D mesh"
        )
    device = _mesh_device(mesh)
    pin_memory = offload.pin_memory if isinstance(offload, CPUOffloadPolicy) else None
    rank, world = dp.shard_rank, dp.shard_size
    post_forward_size = None
    if isinstance(reshard_after_forward, int) and not isinstance(reshard_after_forward, bool):
        if dp.spmd:
            raise NotImplementedError(
                f"reshard_after_forward as int ({reshard_after_forward}) is not supported with dp_mesh_dims: "
                f"fully_shard({name}) reshards fully or not at all on an SPMD mesh; use True or False"
            )
        size = reshard_after_forward
        if size < 1 or world % size:
            raise ValueError(
                f"fully_shard({name}): reshard_after_forward={size} must divide the shard world size {world} "
                f"(e.g. the ranks of one node); use True to reshard fully"
            )
        reshard_after_forward = size != 1  # size == world: plain resharding; 1: keep unsharded
        post_forward_size = size if 1 < size < world else None

    # As in FSDP2, ignored_params may name parameters of other modules too (one set for a whole
    # model, e.g. DDP on some parts and fully_shard on others): those are not this call's business.
    ignored = {id(p) for p in (ignored_params or ())}
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
                f"fully_shard({name}): parameter '{fqn}' is already managed by another fully_shard unit (it is "
                "shared with a module fully_shard was applied to); tied parameters must belong to one unit: "
                "apply fully_shard to their common parent only, or to both modules as one group: "
                "fully_shard([module_a, module_b])"
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
                f"fully_shard({name}): parameter '{fqn}' is a scalar and cannot be sharded. Change "
                f"{fqn.rpartition('.')[2]} to a 1D tensor with numel equal to 1, or pass it in ignored_params"
            )
        dim = placement.dim + param.dim() if placement.dim < 0 else placement.dim
        if not 0 <= dim < param.dim():
            raise ShardDimError(
                f"Shard dim {placement.dim} is invalid for {param.dim()}D tensor: fully_shard({name}): "
                f"shard_placement_fn returned Shard({placement.dim}) for '{fqn}' of shape {tuple(param.shape)}; "
                f"the dim must be in [-{param.dim()}, {param.dim() - 1}]"
            )
        spec = sharded_spec(param, fqn, name, dp, dim, replicated)
        local_shape = param._local_tensor.shape if isinstance(param, DTensor) else param.shape
        plans.append((param, fqn, spec, ShardLayout(tuple(local_shape), dim, 1 if replicated else world)))

    # Everything is validated: from here on the modules are changed.
    for m in modules:
        for buffer_name, buffer in m.named_buffers():
            if buffer.device != device and buffer.device.type != "meta":
                m.get_submodule(buffer_name.rpartition(".")[0])._buffers[buffer_name.rpartition(".")[2]] = buffer.to(device)
    sharded = []
    for param, fqn, spec, layout in plans:
        holders = [(owner, attr) for owner, attr, _ in owners[id(param)]]
        sharded.append(
            ShardedParam(
                param, holders, fqn, layout, spec, 0 if replicated else rank, device, mp.param_dtype, pin_memory,
                mp.main_dtype,
            )
        )
        _mark_managed(param)
        _mark_managed(sharded[-1].sharded)
    flags = lifecycle(strategy, is_root=False, reshard_after_forward=reshard_after_forward)
    group = None
    if sharded:
        group = ParamGroup(
            sharded, dp.shard_group, mp.reduce_dtype, name,
            replicate_group=dp.replicate_group, shard_mesh=dp.shard_mesh, mp_policy=mp,
            all_reduce=flags.all_reduce,
            after_backward=AfterBackward.RESHARD if flags.reshard_after_backward else AfterBackward.KEEP_STORAGE,
        )
        if post_forward_size is not None:
            group.post_forward_group = _post_forward_group(mesh, dp.shard_dim, post_forward_size)
    state = ShardedUnit(modules, group, mp, reshard_after_forward, strategy)
    for m in modules:
        setattr(m, STATE_ATTR, state)
        fsdp2_views.expose(m, state)
        cls = type(m)
        if cls not in FSDP_CLASSES:
            FSDP_CLASSES[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
        m.__class__ = FSDP_CLASSES[cls]
    return module


def _state(module: nn.Module) -> Optional[ShardedUnit]:
    """``fully_shard.state(module)``: fullshard's state of a sharded module (None for any other), as FSDP2's
    ``fully_shard.state`` gives its own."""
    return getattr(module, STATE_ATTR, None)


fully_shard.state = _state
