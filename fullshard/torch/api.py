"""The public entry point: ``fully_shard`` (FSDP2-compatible), which validates everything before it
changes anything, then turns each module into an ``FSDPModule`` (``module.py``)."""
from __future__ import annotations

from collections import OrderedDict
from types import SimpleNamespace
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed._composable.contract import REGISTRY_KEY, STATE_KEY, RegistryItem
from torch.distributed.fsdp import _fully_shard as _torch_api, fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Shard

from fullshard.core.checks import (
    check_modules, check_not_managed, check_reshard_after_forward, owners_of_params, parse_strategy, shard_dim,
)
from fullshard.core.unit import UNIT_ATTR, become_fsdp_module
from fullshard.plan import ShardLayout
from fullshard.plan.exchange import MeshFacts, plan_mesh_groups
from fullshard.plan.group import AfterBackward, Strategy, lifecycle
from fullshard.torch.policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from fullshard.torch.collectives import DataParallelMesh, data_parallel_mesh
from fullshard.torch.errors import AppliedTwiceError, ShardDimError
from fullshard.torch.group import ParamGroup
from fullshard.torch.unit import FSDP_CLASSES, FSDPModule, UnshardHandle, register_fsdp_forward_method  # noqa: F401
from fullshard.torch.param import ShardedParam, sharded_spec
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


# torch's own policy classes, taken once at import: code that later swaps names in
# torch.distributed.fsdp (a test harness running FSDP2's suite on fullshard) must not change them.

_TORCH_MP, _TORCH_OFFLOAD, _TORCH_CPU_OFFLOAD = (
    _torch_api.MixedPrecisionPolicy, _torch_api.OffloadPolicy, _torch_api.CPUOffloadPolicy,
)


def as_mp_policy(policy: object, module_name: str) -> MixedPrecisionPolicy:
    if isinstance(policy, MixedPrecisionPolicy):
        result = policy
    else:
        if not isinstance(policy, _TORCH_MP):
            raise TypeError(
                f"fully_shard({module_name}): mp_policy must be a fullshard.MixedPrecisionPolicy "
                f"or torch's MixedPrecisionPolicy, got {type(policy).__name__}"
            )
        # every field torch's policy has (2.15 added param_dtype_override_fn, which must not be dropped)
        result = MixedPrecisionPolicy(
            policy.param_dtype, policy.reduce_dtype, policy.output_dtype, policy.cast_forward_inputs,
            param_dtype_override_fn=getattr(policy, "param_dtype_override_fn", None),
        )
    for field in ("param_dtype", "reduce_dtype", "output_dtype", "main_dtype"):
        dtype = getattr(result, field)
        if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
            raise ValueError(
                f"fully_shard({module_name}): MixedPrecisionPolicy.{field}={dtype!r} is not a "
                "floating-point torch.dtype; use e.g. torch.bfloat16 or torch.float32, or None"
            )
    override = result.param_dtype_override_fn
    if override is not None and not callable(override):
        raise ValueError(f"fully_shard({module_name}): MixedPrecisionPolicy.param_dtype_override_fn must be callable "
                         f"(parameter -> torch.dtype or None), got {override!r}")
    return result


def as_offload_policy(policy: object, module_name: str) -> OffloadPolicy:
    if isinstance(policy, OffloadPolicy):
        return policy
    if isinstance(policy, _TORCH_CPU_OFFLOAD):
        return CPUOffloadPolicy(pin_memory=policy.pin_memory)
    if isinstance(policy, _TORCH_OFFLOAD):
        return OffloadPolicy()
    raise TypeError(
        f"fully_shard({module_name}): offload_policy must be a fullshard.OffloadPolicy / "
        f"CPUOffloadPolicy or torch's equivalent, got {type(policy).__name__}"
    )


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
    if root is mesh or mesh.mesh.numel() == root.mesh.numel():
        # it holds every rank itself (a mesh made by _unflatten, whose dim names its root does not have)
        layout, index = mesh.mesh, shard_dim
    elif mesh.mesh_dim_names[shard_dim] in (root.mesh_dim_names or ()):
        layout, index = root.mesh, root.mesh_dim_names.index(mesh.mesh_dim_names[shard_dim])
    else:
        raise ValueError(
            f"fully_shard(reshard_after_forward={size}): the mesh's shard dim {mesh.mesh_dim_names[shard_dim]!r} is "
            f"not a dim of its root mesh {root.mesh_dim_names}, so the ranks' blocks cannot be laid out; pass "
            "reshard_after_forward=True or False, or a mesh sliced from the root by name")
    blocks = layout.movedim(index, -1).reshape(-1, size)
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


@dataclass
class _Arguments:
    """``fully_shard``'s arguments, checked, and what follows from them."""

    name: str
    strategy: Strategy
    replicated: bool
    mp: MixedPrecisionPolicy
    pin_memory: Optional[bool]
    reshard_after_forward: Optional[bool]
    post_forward_size: Optional[int]
    mesh: DeviceMesh
    dp: Any
    device: torch.device
    reshard_ranks: Any = None  # reshard_after_forward as given (an int: the block size, checked per mesh)


def fully_shard(
    module: Union[nn.Module, list[nn.Module]],
    *,
    mesh: Optional[DeviceMesh] = None,
    reshard_after_forward: Optional[bool] = None,
    shard_placement_fn: Optional[Callable[[nn.Parameter], Any]] = None,  # Shard, None, ShardPlacementResult
    mp_policy: Any = MixedPrecisionPolicy(),
    offload_policy: Any = OffloadPolicy(),
    ignored_params: Optional[set[nn.Parameter]] = None,
    dp_mesh_dims: Any = None,
    strategy: Union[str, Strategy] = Strategy.OPTIM_GRADS_PARAMS,
) -> Union[nn.Module, list[nn.Module]]:
    """Shard ``module``'s parameters across ``mesh`` (ZeRO-3), FSDP2-compatible.

    Parameters become ``DTensor`` shards (``Shard(0)``, or what ``shard_placement_fn`` returns: any dim, even or
    not, or FSDP2's ``ShardPlacementResult``: a mesh of its own, docs/moe.md). Around each forward
    they are all-gathered in ``mp_policy.param_dtype``; after backward their
    gradients are reduce-scattered in ``mp_policy.reduce_dtype`` and averaged.
    A list of modules forms one communication group. Returns ``module``.

    Parameters that are DTensors already (tensor parallelism) are sharded
    further across ``mesh``'s data-parallel dims; with ``dp_mesh_dims``,
    ``mesh`` is the whole SPMD mesh and names which of its dims those are
    (see ``fullshard.torch.param``).

    ``strategy`` (beyond FSDP2) names how much is sharded: ``"no_shard"``
    (replicate, like DDP), ``"optim"`` (ZeRO-1), ``"optim_grads"`` (ZeRO-2) or
    ``"optim_grads_params"`` (ZeRO-3, the default); see
    ``fullshard.plan.group`` for the flags each one sets.

    Everything is checked before anything changes: on an error the modules keep their class, parameters and
    hooks.
    """
    modules = list(module) if isinstance(module, (list, tuple)) else [module]
    name = ", ".join(type(m).__name__ for m in modules)
    check_modules(modules, name, is_module=lambda m: isinstance(m, nn.Module), kind="nn.Module(s)",
                  is_container=lambda m: isinstance(m, (nn.ModuleList, nn.ModuleDict)), forward="forward",
                  applied_twice=AppliedTwiceError)
    args = _check_arguments(name, mesh, reshard_after_forward, mp_policy, offload_policy, dp_mesh_dims, strategy)
    owners, plans = _plan_params(modules, args, shard_placement_fn, ignored_params)
    _apply(modules, args, owners, plans)
    return module


def _check_arguments(name: str, mesh: Optional[DeviceMesh], reshard_after_forward: Any, mp_policy: Any,
                     offload_policy: Any, dp_mesh_dims: Any, strategy: Any) -> _Arguments:
    strategy = parse_strategy(strategy, name)
    replicated = strategy is Strategy.NO_SHARD
    mp = as_mp_policy(mp_policy, name)
    offload = as_offload_policy(offload_policy, name)
    check_reshard_after_forward(reshard_after_forward, name, allow_int=True)
    raw_reshard = reshard_after_forward
    mesh = mesh if mesh is not None else _default_mesh()
    # The last mesh dim shards; a leading dim (HSDP) replicates and all-reduces gradients.
    dp = data_parallel_mesh(mesh, dp_mesh_dims, name)
    if dp.shard_dim is None:  # dp_mesh_dims(replicate=...) only: replicas, as with no_shard
        strategy, replicated = Strategy.NO_SHARD, True
    elif replicated and dp.replicate_dim is not None:
        raise ValueError(f"fully_shard({name}): strategy 'no_shard' replicates over the whole mesh; pass a 1-D mesh")
    reshard_after_forward, post_forward_size = _post_forward_size(reshard_after_forward, dp, name)
    pin_memory = offload.pin_memory if isinstance(offload, CPUOffloadPolicy) else None
    return _Arguments(name, strategy, replicated, mp, pin_memory, reshard_after_forward, post_forward_size, mesh, dp,
                      _mesh_device(mesh), raw_reshard)


def _post_forward_size(reshard_after_forward: Any, dp: Any, name: str) -> tuple[Optional[bool], Optional[int]]:
    """``reshard_after_forward=k``: reshard to blocks of ``k`` ranks (None: fully, or not at all)."""
    if not isinstance(reshard_after_forward, int) or isinstance(reshard_after_forward, bool):
        return reshard_after_forward, None
    if dp.spmd:
        raise NotImplementedError(
            f"reshard_after_forward as int ({reshard_after_forward}) is not supported with dp_mesh_dims: "
            f"fully_shard({name}) reshards fully or not at all on an SPMD mesh; use True or False"
        )
    size, world = reshard_after_forward, dp.shard_size
    if size < 1 or world % size:
        raise ValueError(
            f"fully_shard({name}): reshard_after_forward={size} must divide the shard world size {world} "
            f"(e.g. the ranks of one node); use True to reshard fully"
        )
    # size == world: plain resharding; 1: keep unsharded
    return size != 1, (size if 1 < size < world else None)


def _plan_params(modules: list[nn.Module], args: _Arguments, shard_placement_fn: Any, ignored_params: Any) -> tuple:
    """Each managed parameter's holders, spec and layout; refused here (naming it) if it cannot be sharded."""
    # As in FSDP2, ignored_params may name parameters of other modules too (one set for a whole
    # model, e.g. DDP on some parts and fully_shard on others): those are not this call's business.
    ignored = {id(p) for p in (ignored_params or ())}
    owners, params = _owners_of_params(modules, ignored)
    plans, meshes = [], {}
    for key, param in params.items():
        fqn = owners[key][0][2]
        check_not_managed(_is_managed(param), isinstance(param, DTensor), fqn, args.name)
        if not _device_accepted(param.device, args.device):
            raise ValueError(
                f"fully_shard({args.name}): parameter '{fqn}' is on {param.device} but the mesh uses {args.device}; "
                f"move the module to {args.device} (or to the CPU or meta device, which fully_shard moves) first"
            )
        result = shard_placement_fn(param) if shard_placement_fn is not None else None
        placement, dp = _placement_and_mesh(result, args, fqn, meshes)
        dim = shard_dim(placement, Shard, tuple(param.shape), fqn, args.name, ShardDimError)
        spec = sharded_spec(param, fqn, args.name, dp, dim, args.replicated)
        local_shape = param._local_tensor.shape if isinstance(param, DTensor) else param.shape
        # the override is asked once per parameter, before anything changes (its errors leave the model as it was)
        compute = args.mp.compute_dtype_of(param) if args.mp.param_dtype_override_fn else args.mp.param_dtype
        layout = ShardLayout(tuple(local_shape), dim, 1 if args.replicated else dp.shard_size)
        plans.append((param, fqn, spec, layout, dp, compute))
    return owners, plans


def _placement_and_mesh(result: Any, args: _Arguments, fqn: str, meshes: dict) -> tuple[Any, DataParallelMesh]:
    """``shard_placement_fn``'s answer for ``fqn``: ``Shard(dim)`` or None on the call's mesh, or FSDP2's
    ``ShardPlacementResult(placement, mesh_info)`` (torch's class or any with those fields): that placement on
    ``mesh_info.mesh`` (an expert mesh). One mesh per mesh-info object (``meshes`` also keeps it alive)."""
    info = getattr(result, "mesh_info", None)
    if info is None or id(info) in meshes:
        return getattr(result, "placement", result), meshes[id(info)][1] if info is not None else args.dp
    where = f"fully_shard({args.name}): shard_placement_fn put '{fqn}' on mesh_info {info!r}"
    mesh, shard, replicate = (getattr(info, name, None) for name in ("mesh", "shard_mesh_dim", "replicate_mesh_dim"))
    if args.dp.spmd or args.replicated:
        raise NotImplementedError(f"{where}: a mesh per parameter is not supported with dp_mesh_dims or strategy "
                                  "'no_shard'; shard these parameters in a fully_shard call of their own on that mesh")
    if not isinstance(mesh, DeviceMesh) or not ((mesh.ndim, shard, replicate) == (1, 0, None) or (
            mesh.ndim == 2 and mesh.mesh_dim_names is not None and {shard, replicate} == {0, 1})):
        raise ValueError(f"{where}, which names no data-parallel mesh; build FSDPMeshInfo(mesh, shard_mesh_dim=0) on "
                         "a 1-D mesh, or HSDPMeshInfo(mesh, shard_mesh_dim=1, replicate_mesh_dim=0) on a named 2-D one")
    if _mesh_device(mesh) != args.device:
        raise ValueError(f"{where}, a {mesh.device_type} mesh, but the call's mesh uses {args.device}; build both "
                         "meshes on one device type")
    meshes[id(info)] = (info, DataParallelMesh(mesh, shard, replicate, spmd=False))
    return result.placement, meshes[id(info)][1]


def _apply(modules: list[nn.Module], args: _Arguments, owners: dict, plans: list) -> None:
    """Everything is checked: change the modules (buffers moved, parameters sharded, hooks, class)."""
    for m in modules:
        for buffer_name, buffer in m.named_buffers():
            if buffer.device != args.device and buffer.device.type != "meta":
                m.get_submodule(buffer_name.rpartition(".")[0])._buffers[buffer_name.rpartition(".")[2]] = \
                    buffer.to(args.device)
    sharded = []
    for param, fqn, spec, layout, dp, compute_dtype in plans:
        holders = [(owner, attr) for owner, attr, _ in owners[id(param)]]
        sharded.append(ShardedParam(param, holders, fqn, layout, spec, 0 if args.replicated else dp.shard_rank,
                                    args.device, compute_dtype, args.pin_memory, args.mp.main_dtype))
        _mark_managed(param)
        _mark_managed(sharded[-1].sharded)
    unit = ShardedUnit(modules, _groups(sharded, [plan[4] for plan in plans], args), args.mp,
                       args.reshard_after_forward, args.strategy)
    for m in modules:
        become_fsdp_module(m, FSDPModule, FSDP_CLASSES, unit)
        _expose_to_torch(m, unit)


def _expose_to_torch(module: nn.Module, unit: ShardedUnit) -> None:
    """Answer ``torch.distributed.fsdp.fully_shard.state(module)`` with a view of ``unit`` (``StateView``), and
    mark the module in torch's registry of composable APIs as ``fully_shard``ed: torch's ``replicate()`` applied
    over fullshard units (DDP on the root) then leaves their parameters to fullshard, as it does FSDP2's."""
    # fully_shard.state(m) looks its state up under the undecorated function.
    module.__dict__.setdefault(STATE_KEY, {})[torch_fully_shard.__wrapped__] = StateView(unit)
    module.__dict__.setdefault(REGISTRY_KEY, OrderedDict()).setdefault("fully_shard", RegistryItem())


class StateView:
    """What ``torch.distributed.fsdp.fully_shard.state(module)`` returns for a fullshard module.

    Most of torch's distributed code only calls ``FSDPModule`` methods, which fullshard defines.
    ``torch.distributed.pipelining`` also reaches into the state: after the last micro-batch of a schedule it
    reduces the gradients itself, through ``fully_shard.state(module)._state_ctx.all_states``, each state's
    ``_fsdp_param_groups[i].post_backward()``, then the root's ``_root_post_backward_final_callback()``. This
    read-only view answers those three calls with fullshard's own reduction; nothing else of FSDP2's state
    exists.
    """

    def __init__(self, state: ShardedUnit) -> None:
        self._state = state

    @property
    def _fsdp_param_groups(self) -> list[SimpleNamespace]:
        if self._state.group is None:
            return []
        return [SimpleNamespace(post_backward=self._state.reduce_accumulated_grads)]

    @property
    def _state_ctx(self) -> SimpleNamespace:
        states = self._state.root.units if self._state.root is not None else [self._state]
        return SimpleNamespace(all_states=[StateView(state) for state in states])

    def _root_post_backward_final_callback(self) -> None:
        (self._state.root or self._state.lazy_init_as_root()).complete_backward()


def _groups(sharded: list[ShardedParam], dps: list[DataParallelMesh], args: _Arguments) -> list[ParamGroup]:
    """One group per mesh (``plan.exchange.plan_mesh_groups``), all dividing by the call's data-parallel size."""
    def facts(dp: DataParallelMesh) -> MeshFacts:
        shard, replicate = dp.shard_group, dp.replicate_group
        replicas = dist.get_world_size(replicate) if replicate is not None else 1
        return MeshFacts((id(shard), id(replicate)), dist.get_world_size(shard), replicas)

    split = plan_mesh_groups(facts(args.dp), [facts(dp) for dp in dps])
    groups = [_group([sharded[i] for i in members], dps[members[0]], args) for members in split.members]
    for group in groups:
        group.default_divide_factor = split.divide_factor
    return groups


def _group(sharded: list[ShardedParam], dp: DataParallelMesh, args: _Arguments) -> ParamGroup:
    flags = lifecycle(args.strategy, is_root=False, reshard_after_forward=args.reshard_after_forward)
    group = ParamGroup(
        sharded, dp.shard_group, args.mp.reduce_dtype, args.name,
        replicate_group=dp.replicate_group, shard_mesh=dp.shard_mesh, mp_policy=args.mp,
        all_reduce=flags.all_reduce,
        after_backward=AfterBackward.RESHARD if flags.reshard_after_backward else AfterBackward.KEEP_STORAGE,
    )
    # reshard_after_forward=k: blocks of k ranks of each mesh (k must divide every mesh's shard size)
    post_forward_size = _post_forward_size(args.reshard_ranks, dp, args.name)[1]
    if post_forward_size is not None:
        refuse_released_outputs_for_partial_reshard(sharded)
        group.post_forward_group = _post_forward_group(dp.mesh, dp.shard_dim, post_forward_size)
    return group


def refuse_released_outputs_for_partial_reshard(sharded: list[ShardedParam]) -> None:
    """reshard_after_forward=k keeps this rank's chunks of the gather outputs for its block: outputs released
    right after the post hook would be gone. Refused at fully_shard, as FSDP2 2.15 does (its type and words)."""
    if any(param.release_gather_outputs for param in sharded):
        raise NotImplementedError(
            "Releasing all-gather outputs after post-all-gather is not supported when reshard_after_forward is an "
            "int because FSDP uses those outputs to construct the post-forward shard"
        )


def _state(module: nn.Module) -> Optional[ShardedUnit]:
    """``fully_shard.state(module)``: fullshard's state of a sharded module (None for any other), as FSDP2's
    ``fully_shard.state`` gives its own."""
    return getattr(module, UNIT_ATTR, None)


fully_shard.state = _state
