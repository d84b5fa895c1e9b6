"""The public entry point: ``fully_shard`` for PyNative Cells, which validates everything before it changes
anything, then turns each cell into an ``FSDPModule`` (``module.py``)."""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Union

from mindspore import Parameter, nn

from fullshard.core.checks import (
    check_modules, check_not_managed, check_reshard_after_forward, owners_of_params, parse_strategy, shard_dim,
)
from fullshard.core.unit import become_fsdp_module
from fullshard.mindspore.autograd import in_pynative_mode
from fullshard.mindspore.collectives import FLOAT_DTYPES, Comm, DeviceMesh, Shard, default_mesh
from fullshard.mindspore.group import ParamGroup
from fullshard.mindspore.unit import FSDP_CLASSES, FSDPModule, ShardedUnit
from fullshard.mindspore.param import MANAGED_ATTR, ShardedParam
from fullshard.mindspore.policies import MixedPrecisionPolicy, OffloadPolicy
from fullshard.plan import DEFAULT_FUSE_BELOW_NUMEL, Exchange, ShardLayout
from fullshard.plan.exchange import Collectives, MeshFacts, choose_collectives, plan_mesh_groups
from fullshard.plan.group import AfterBackward, Strategy, lifecycle

def check_mp_policy(policy: Any, cell_name: str) -> MixedPrecisionPolicy:
    if policy is None:
        return MixedPrecisionPolicy()
    if not isinstance(policy, MixedPrecisionPolicy):
        raise TypeError(
            f"fully_shard({cell_name}): mp_policy must be a fullshard.mindspore.MixedPrecisionPolicy, "
            f"got {type(policy).__name__}"
        )
    for field in ("param_dtype", "reduce_dtype", "output_dtype"):
        dtype = getattr(policy, field)
        if dtype is not None and dtype not in FLOAT_DTYPES:
            raise ValueError(
                f"fully_shard({cell_name}): MixedPrecisionPolicy.{field}={dtype!r} is not a floating-point "
                "MindSpore dtype; use e.g. ms.float16 or ms.float32, or None"
            )
    return policy


def check_offload_policy(policy: Any, cell_name: str) -> OffloadPolicy:
    if policy is None or type(policy) is OffloadPolicy:
        return OffloadPolicy()
    raise ValueError(
        f"fully_shard({cell_name}): offload_policy={policy!r} is not supported by fullshard.mindspore, which keeps "
        "shards on the device they compute on; pass None"
    )


def _owners_of_params(cells: list[nn.Cell]) -> tuple[dict[int, list[tuple[nn.Cell, str, str]]], dict[int, Parameter]]:
    """Every (cell, attribute name, path) holding each parameter, skipping cells already sharded."""
    return owners_of_params(cells, lambda c: c._params.items(), lambda c: c._cells.items())


def _display_name(cell: nn.Cell) -> str:
    """The cell's own class name, also once fully_shard swapped in FSDP<Class>(FSDPModule, Class)."""
    return type(cell).__bases__[1].__name__ if isinstance(cell, FSDPModule) else type(cell).__name__


def _all_params(cells: list[nn.Cell]) -> dict[int, Parameter]:
    """Every parameter reachable from ``cells``, sharded units below included."""
    found = {}
    for cell in cells:
        for sub in (c for _, c in cell.cells_and_names()):
            for param in sub._params.values():
                if param is not None:
                    found[id(param)] = param
    return found


def _param_set(values: Optional[Iterable[Parameter]], argument: str, name: str, reachable: dict) -> set[int]:
    chosen = list(values or ())
    for param in chosen:
        if not isinstance(param, Parameter):
            raise TypeError(f"fully_shard({name}): {argument} must hold Parameters, got {type(param).__name__}")
    missing = [getattr(p, "name", repr(p)) for p in chosen if id(p) not in reachable]
    if missing:
        raise ValueError(
            f"fully_shard({name}): {argument} names parameters that are not in the cell: {', '.join(missing)}; "
            "pass parameters of the cell being sharded (e.g. from cell.trainable_params())"
        )
    return {id(p) for p in chosen}


@dataclass
class _Arguments:
    """``fully_shard``'s arguments, checked, and what follows from them."""

    name: str
    strategy: Strategy
    mp: Any
    reshard_after_forward: Optional[bool]
    mesh: DeviceMesh
    fuse_below_numel: int


def fully_shard(
    cell: Union[nn.Cell, list[nn.Cell]],
    *,
    mesh: Optional[DeviceMesh] = None,
    reshard_after_forward: Optional[bool] = None,
    shard_placement_fn: Optional[Callable[[Parameter], Any]] = None,
    mp_policy: Any = None,
    offload_policy: Any = None,
    ignored_params: Optional[Iterable[Parameter]] = None,
    replicate_params: Optional[Iterable[Parameter]] = None,
    strategy: Union[str, Strategy, None] = None,
    comm_fusion: bool = True,
) -> Union[nn.Cell, list[nn.Cell]]:
    """Shard ``cell``'s parameters across ``mesh`` (ZeRO-3 by default), in place; returns ``cell``.

    After it, ``cell.trainable_params()`` are this rank's shards (``Shard(0)``, or what
    ``shard_placement_fn`` returns), under the names from before; ``value_and_grad`` over them
    returns this rank's chunk of the gradient, averaged over the data-parallel ranks. A list of
    cells forms one communication group.

    * ``mesh``: 1-D (shard) or 2-D (replicate, shard) for HSDP; None: 1-D over every rank.
    * ``shard_placement_fn(param)``: ``Shard(dim)``, None (dim 0), or ``(Shard(dim) or None, mesh)`` to put the
      parameter on a mesh of its own (MoE experts on an expert mesh); one group per mesh, every group's
      gradients divided by the call's data-parallel size (``fullshard.plan.exchange.plan_mesh_groups``).
    * ``reshard_after_forward``: free the unsharded parameters after forward and gather them again
      for backward; None: the strategy's choice (ZeRO-3: yes, except for the root).
    * ``strategy``: ``"no_shard"``, ``"optim"``, ``"optim_grads"`` or ``"optim_grads_params"`` (the
      default), with ``fullshard.plan.group``'s meaning.
    * ``replicate_params`` stay whole on every rank, their gradients all-reduced;
      ``ignored_params`` are left alone.
    * ``comm_fusion`` (default True): parameters below ``fullshard.plan.DEFAULT_FUSE_BELOW_NUMEL`` elements
      per rank share a unit's gather, and their gradients share one reduction across the units whose
      backward has completed; larger ones travel alone (zero copy where the plan allows). False: every
      parameter alone, as the seed's library did.

    Everything is checked before anything changes: on an error the cells keep their class, parameters and
    hooks.
    """
    cells = list(cell) if isinstance(cell, (list, tuple)) else [cell]
    name = ", ".join(_display_name(c) for c in cells)
    if not in_pynative_mode():
        raise RuntimeError(
            f"fully_shard({name}) runs in PyNative mode only; call ms.set_context(mode=ms.PYNATIVE_MODE) first"
        )
    check_modules(cells, name, is_module=lambda c: isinstance(c, nn.Cell), kind="mindspore.nn.Cell(s)",
                  is_container=lambda c: isinstance(c, (nn.CellList, nn.CellDict)), forward="construct", word="cell")
    args = _check_arguments(name, mesh, reshard_after_forward, mp_policy, offload_policy, strategy, comm_fusion)
    plans = _plan_params(cells, args, shard_placement_fn, ignored_params, replicate_params)
    _apply(cells, args, plans)
    return cell


def _check_arguments(name: str, mesh: Any, reshard_after_forward: Any, mp_policy: Any, offload_policy: Any,
                     strategy: Any, comm_fusion: Any) -> _Arguments:
    strategy = parse_strategy(strategy, name)
    mp = check_mp_policy(mp_policy, name)
    check_offload_policy(offload_policy, name)
    check_reshard_after_forward(reshard_after_forward, name, allow_int=False)
    if not isinstance(comm_fusion, bool):
        raise ValueError(f"fully_shard({name}): comm_fusion={comm_fusion!r} must be True or False")
    mesh = mesh if mesh is not None else default_mesh()
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            f"fully_shard({name}): mesh must come from fullshard.mindspore.init_device_mesh, got {type(mesh).__name__}"
        )
    if mesh.ndim == 2 and strategy is Strategy.NO_SHARD:
        raise ValueError(f"fully_shard({name}): strategy 'no_shard' replicates over the whole mesh; pass a 1-D mesh")
    return _Arguments(name, strategy, mp, reshard_after_forward, mesh, DEFAULT_FUSE_BELOW_NUMEL if comm_fusion else 0)


def _plan_params(cells: list[nn.Cell], args: _Arguments, shard_placement_fn: Any, ignored_params: Any,
                 replicate_params: Any) -> list[tuple]:
    """Each managed parameter's holders, layout and whether it is replicated; refused here, naming it, if it
    cannot be sharded."""
    reachable = _all_params(cells)
    ignored = _param_set(ignored_params, "ignored_params", args.name, reachable)
    replicated_ids = _param_set(replicate_params, "replicate_params", args.name, reachable)
    both = ignored & replicated_ids
    if both:
        raise ValueError(f"fully_shard({args.name}): {reachable[next(iter(both))].name} is in both ignored_params and "
                         "replicate_params; it can be one or the other")
    owners, params = _owners_of_params(cells)
    plans = []
    for key, param in params.items():
        if key in ignored:
            continue
        path = owners[key][0][2]
        check_not_managed(getattr(param, MANAGED_ATTR, False), False, path, args.name)
        _check_not_meta(param, path, args.name)
        replicated = args.strategy is Strategy.NO_SHARD or key in replicated_ids
        # Asked under no_shard too, only so that a mesh of the parameter's own is refused rather than ignored.
        answer = shard_placement_fn(param) if shard_placement_fn is not None and key not in replicated_ids else None
        placement, mesh = _placement_and_mesh(answer, args, path)
        placement = None if replicated else placement
        dim = shard_dim(placement, Shard, tuple(param.shape), path, args.name)
        layout = ShardLayout(tuple(param.shape), dim, 1 if replicated else mesh.size(mesh.ndim - 1))
        plans.append((param, [(c, attr) for c, attr, _ in owners[key]], path, layout, replicated, mesh))
        _warn_empty_shards(layout, path, args.name)
    return plans


def _placement_and_mesh(answer: Any, args: _Arguments, path: str) -> tuple[Any, DeviceMesh]:
    """``shard_placement_fn`` answers ``Shard(dim)``, None, or ``(Shard(dim) or None, mesh)``: a mesh of the
    parameter's own (MoE experts on their expert-FSDP mesh, as FSDP2's ``ShardPlacementResult``)."""
    if not isinstance(answer, tuple):
        return answer, args.mesh
    if len(answer) != 2 or not isinstance(answer[1], DeviceMesh):
        raise ValueError(
            f"fully_shard({args.name}): shard_placement_fn returned {answer!r} for '{path}'; a tuple must be "
            "(Shard(dim) or None, mesh) with a mesh from fullshard.mindspore.init_device_mesh"
        )
    if args.strategy is Strategy.NO_SHARD:
        raise ValueError(
            f"fully_shard({args.name}): shard_placement_fn gave '{path}' a mesh of its own, but strategy "
            "'no_shard' replicates everything over the call's mesh; return Shard(dim) or None instead"
        )
    return answer


def _check_not_meta(param: Parameter, path: str, name: str) -> None:
    """A meta parameter has no data to cut outside ``ms.DeviceCtx("meta")`` (MindSpore's own error says only
    "Cannot use meta tensor"); inside it, fully_shard works and ``cell.to_empty()`` materializes afterwards."""
    if getattr(param, "is_meta", False) and _current_device() != "meta":
        raise RuntimeError(
            f"fully_shard({name}): parameter '{path}' is on the meta device; call fully_shard inside "
            "`with ms.DeviceCtx(\"meta\"):` and then `cell.to_empty(device=\"CPU\")` (fullshard allocates its own "
            "buffers then) and initialize the shards, or create the cell outside the meta context"
        )


def _current_device() -> str:
    from mindspore.device_manager import get_current_device

    return get_current_device().device_target


def _warn_empty_shards(layout: ShardLayout, path: str, name: str) -> None:
    empty = [r for r in range(layout.world) if layout.local_length(r) == 0]
    if empty:
        warnings.warn(
            f"fully_shard({name}): parameter '{path}' has {layout.dim_size} rows on dim {layout.dim} for "
            f"{layout.world} ranks, so rank(s) {empty} hold none of it; MindSpore's optimizers cannot create "
            "state for an empty Parameter (nn.Adam raises). Shard it on another dim (shard_placement_fn) or "
            "pass it in replicate_params", UserWarning, stacklevel=4,
        )


def _comms(mesh: DeviceMesh) -> tuple[Comm, Optional[Comm]]:
    """The mesh's shard group and, for HSDP with more than one replica, its replica group."""
    shard = mesh.ndim - 1
    shard_comm = Comm(mesh.get_group(shard), mesh.size(shard), mesh.get_local_rank(shard))
    if mesh.ndim == 1 or mesh.size(0) == 1:
        return shard_comm, None
    return shard_comm, Comm(mesh.get_group(0), mesh.size(0), mesh.get_local_rank(0))


def _facts(mesh: DeviceMesh) -> MeshFacts:
    """Meshes whose groups are the same (by name and ranks) gather and reduce together, whatever object holds them."""
    shard, replica = _comms(mesh)
    key = (shard.group, shard.size, replica.group if replica else None, replica.size if replica else 1)
    return MeshFacts(key, shard.size, replica.size if replica else 1)


def _apply(cells: list[nn.Cell], args: _Arguments, plans: list[tuple]) -> None:
    """Everything is checked. Shards and plans are made first (nothing the cells see), then installed."""
    sharded = [
        ShardedParam(param, holders, path, layout, mesh.get_local_rank(mesh.ndim - 1), args.mp.param_dtype,
                     args.mp.apply_grad_on_fp32_main_grad, replicated)
        for param, holders, path, layout, replicated, mesh in plans
    ]
    # One group per mesh (and per kind: sharded, replicated), all dividing by the call's data-parallel size.
    split = plan_mesh_groups(_facts(args.mesh), [_facts(plan[5]) for plan in plans])
    groups = []
    for members in split.members:
        for replicated in (False, True):
            chosen = [sharded[i] for i in members if sharded[i].replicated is replicated]
            if chosen:
                groups.append(_group(chosen, plans[members[0]][5], args, replicated))
                groups[-1].default_divide_factor = float(split.divide_factor)
    # From here on the cells are changed.
    for param in sharded:
        param.install()
    unit = ShardedUnit(cells, groups, args.mp, args.reshard_after_forward, args.strategy)
    for c in cells:
        become_fsdp_module(c, FSDPModule, FSDP_CLASSES, unit, object.__setattr__)


def _group(members: list[ShardedParam], mesh: DeviceMesh, args: _Arguments, replicated: bool) -> ParamGroup:
    shard_comm, replica_comm = _comms(mesh)
    flags = lifecycle(args.strategy, is_root=False, reshard_after_forward=args.reshard_after_forward)
    if replicated:  # nothing to gather; gradients are all-reduced
        how = Collectives(Exchange.LOCAL, Exchange.COLLECTIVE if shard_comm.size > 1 else Exchange.LOCAL)
    else:
        how = choose_collectives(mesh.backend, shard_comm.size, mesh.is_world_group(mesh.ndim - 1))
    return ParamGroup(
        members, shard_comm, replica_comm, args.mp.reduce_dtype, args.name, how, mesh.backend,
        args.fuse_below_numel, replicated=replicated,
        after_backward=AfterBackward.RESHARD if flags.reshard_after_backward else AfterBackward.KEEP_STORAGE,
    )
