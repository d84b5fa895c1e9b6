"""The public entry point: ``fully_shard`` for PyNative Cells, which validates everything before it changes
anything, then turns each cell into an ``FSDPModule`` (``module.py``)."""
from __future__ import annotations

import warnings
from typing import Any, Callable, Iterable, Optional, Union

from mindspore import Parameter, nn

from fullshard.core.units import STATE_ATTR, owners_of_params
from fullshard.mindspore.autograd import in_pynative_mode
from fullshard.mindspore.collectives import Comm
from fullshard.mindspore.group import ParamGroup
from fullshard.mindspore.mesh import DeviceMesh, Shard, default_mesh
from fullshard.mindspore.module import FSDP_CLASSES, FSDPModule
from fullshard.mindspore.param import MANAGED_ATTR, ShardedParam
from fullshard.mindspore.policies import check_mp_policy, check_offload_policy
from fullshard.mindspore.unit import ShardedUnit
from fullshard.plan import DEFAULT_FUSE_BELOW_NUMEL, Exchange, ShardLayout
from fullshard.plan.backends import Collectives, choose_collectives
from fullshard.plan.strategy import AfterBackward, Strategy, lifecycle

def _owners_of_params(cells: list[nn.Cell]) -> tuple[dict[int, list[tuple[nn.Cell, str, str]]], dict[int, Parameter]]:
    """Every (cell, attribute name, path) holding each parameter, skipping cells already sharded."""
    return owners_of_params(cells, lambda c: c._params.items(), lambda c: c._cells.items())


def _display_name(cell: nn.Cell) -> str:
    """The cell's own class name, also once fully_shard swapped in FSDP<Class>(FSDPModule, Class)."""
    return type(cell).__mro__[2].__name__ if isinstance(cell, FSDPModule) else type(cell).__name__


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


def fully_shard(
    cell: Union[nn.Cell, list[nn.Cell]],
    *,
    mesh: Optional[DeviceMesh] = None,
    reshard_after_forward: Optional[bool] = None,
    shard_placement_fn: Optional[Callable[[Parameter], Optional[Shard]]] = None,
    mp_policy: Any = None,
    offload_policy: Any = None,
    ignored_params: Optional[Iterable[Parameter]] = None,
    replicate_params: Optional[Iterable[Parameter]] = None,
    strategy: Union[str, Strategy, None] = None,
    comm_fusion: bool = False,
) -> Union[nn.Cell, list[nn.Cell]]:
    """Shard ``cell``'s parameters across ``mesh`` (ZeRO-3 by default), in place; returns ``cell``.

    After it, ``cell.trainable_params()`` are this rank's shards (``Shard(0)``, or what
    ``shard_placement_fn`` returns), under the names from before; ``value_and_grad`` over them
    returns this rank's chunk of the gradient, averaged over the data-parallel ranks. A list of
    cells forms one communication group.

    * ``mesh``: 1-D (shard) or 2-D (replicate, shard) for HSDP; None: 1-D over every rank.
    * ``reshard_after_forward``: free the unsharded parameters after forward and gather them again
      for backward; None: the strategy's choice (ZeRO-3: yes, except for the root).
    * ``strategy``: ``"no_shard"``, ``"optim"``, ``"optim_grads"`` or ``"optim_grads_params"`` (the
      default), with ``fullshard.plan.strategy``'s meaning.
    * ``replicate_params`` stay whole on every rank, their gradients all-reduced;
      ``ignored_params`` are left alone.
    * ``comm_fusion``: small parameters of one group share one collective.
    """
    cells = list(cell) if isinstance(cell, (list, tuple)) else [cell]
    name = ", ".join(_display_name(c) for c in cells)
    if not in_pynative_mode():
        raise RuntimeError(
            f"fully_shard({name}) runs in PyNative mode only; call ms.set_context(mode=ms.PYNATIVE_MODE) first"
        )
    for c in cells:
        if not isinstance(c, nn.Cell):
            raise TypeError(f"fully_shard expects mindspore.nn.Cell(s), got {type(c).__name__}")
        if isinstance(c, (nn.CellList, nn.CellDict)):
            raise ValueError(
                f"fully_shard({type(c).__name__}): a container without construct is never called, so its "
                "parameters would never be gathered; shard the cells it holds, or pass them as a list to form "
                "one group: fully_shard(list(container), ...)"
            )
        if hasattr(c, STATE_ATTR):
            raise ValueError(
                f"fully_shard was already applied to {_display_name(c)}; apply it once per cell "
                "(children first, then parents)"
            )
    try:
        strategy = Strategy.parse(strategy if strategy is not None else Strategy.OPTIM_GRADS_PARAMS)
    except ValueError as error:
        raise ValueError(f"fully_shard({name}): {error}") from None
    mp = check_mp_policy(mp_policy, name)
    check_offload_policy(offload_policy, name)
    if reshard_after_forward is not None and not isinstance(reshard_after_forward, bool):
        raise ValueError(f"fully_shard({name}): reshard_after_forward={reshard_after_forward!r} must be True, False or None")
    if not isinstance(comm_fusion, bool):
        raise ValueError(f"fully_shard({name}): comm_fusion={comm_fusion!r} must be True or False")
    mesh = mesh if mesh is not None else default_mesh()
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            f"fully_shard({name}): mesh must come from fullshard.mindspore.init_device_mesh, got {type(mesh).__name__}"
        )
    if mesh.ndim == 2 and strategy is Strategy.NO_SHARD:
        raise ValueError(f"fully_shard({name}): strategy 'no_shard' replicates over the whole mesh; pass a 1-D mesh")

    reachable = _all_params(cells)
    ignored = _param_set(ignored_params, "ignored_params", name, reachable)
    replicated_ids = _param_set(replicate_params, "replicate_params", name, reachable)
    both = ignored & replicated_ids
    if both:
        raise ValueError(f"fully_shard({name}): {reachable[next(iter(both))].name} is in both ignored_params and "
                         "replicate_params; it can be one or the other")
    owners, params = _owners_of_params(cells)
    shard_dim = mesh.ndim - 1  # the last mesh dim shards; a leading one (HSDP) replicates
    rank, world = mesh.get_local_rank(shard_dim), mesh.size(shard_dim)
    plans = []
    for key, param in params.items():
        if key in ignored:
            continue
        path = owners[key][0][2]
        if getattr(param, MANAGED_ATTR, False):
            raise ValueError(
                f"fully_shard({name}): parameter '{path}' is already managed by fully_shard on another cell "
                "(a child wrapped first shares it, or it is tied to one); tied parameters must belong to one unit: "
                "apply fully_shard to their common parent only"
            )
        replicated = strategy is Strategy.NO_SHARD or key in replicated_ids
        if not param.shape:
            raise ValueError(
                f"fully_shard({name}): parameter '{path}' is a scalar and cannot be sharded or replicated by "
                "fully_shard; pass it in ignored_params or give it shape (1,)"
            )
        dim = 0
        if shard_placement_fn is not None and not replicated:
            placement = shard_placement_fn(param)
            if placement is not None and not isinstance(placement, Shard):
                raise ValueError(
                    f"fully_shard({name}): shard_placement_fn returned {placement!r} for '{path}'; it must return "
                    "Shard(dim) or None"
                )
            dim = placement.dim if placement is not None else 0
            ndim = len(param.shape)
            dim = dim + ndim if dim < 0 else dim
            if not 0 <= dim < ndim:
                raise ValueError(
                    f"fully_shard({name}): shard_placement_fn returned Shard({placement.dim}) for '{path}' of shape "
                    f"{tuple(param.shape)}; the dim must be in [-{ndim}, {ndim - 1}]"
                )
        layout = ShardLayout(tuple(param.shape), dim, 1 if replicated else world)
        plans.append((param, [(c, attr) for c, attr, _ in owners[key]], path, layout, replicated))
        empty = [r for r in range(layout.world) if layout.local_length(r) == 0]
        if empty:
            warnings.warn(
                f"fully_shard({name}): parameter '{path}' has {layout.dim_size} rows on dim {layout.dim} for "
                f"{layout.world} ranks, so rank(s) {empty} hold none of it; MindSpore's optimizers cannot create "
                "state for an empty Parameter (nn.Adam raises). Shard it on another dim (shard_placement_fn) or "
                "pass it in replicate_params", UserWarning, stacklevel=2,
            )

    # Everything is validated. Shards and plans are made first (nothing the cells see), then installed.
    shard_comm = Comm(mesh.get_group(shard_dim), world, rank)
    replica_comm = Comm(mesh.get_group(0), mesh.size(0), mesh.get_local_rank(0)) if mesh.ndim == 2 else None
    if replica_comm is not None and replica_comm.size == 1:
        replica_comm = None
    flags = lifecycle(strategy, is_root=False, reshard_after_forward=reshard_after_forward)
    fuse = DEFAULT_FUSE_BELOW_NUMEL if comm_fusion else 0
    sharded = [
        ShardedParam(param, holders, path, layout, rank, mp.param_dtype, mp.apply_grad_on_fp32_main_grad, replicated)
        for param, holders, path, layout, replicated in plans
    ]
    groups = []
    for replicated in (False, True):
        members = [p for p in sharded if p.replicated is replicated]
        if not members:
            continue
        if replicated:  # nothing to gather; gradients are all-reduced
            collectives = Collectives(Exchange.LOCAL, Exchange.COLLECTIVE if world > 1 else Exchange.LOCAL)
        else:
            collectives = choose_collectives(mesh.backend, world, mesh.is_world_group(shard_dim))
        groups.append(ParamGroup(
            members, shard_comm, replica_comm, mp.reduce_dtype, name, collectives, mesh.backend, fuse,
            replicated=replicated,
            after_backward=AfterBackward.RESHARD if flags.reshard_after_backward else AfterBackward.KEEP_STORAGE,
        ))
    # From here on the cells are changed.
    for param in sharded:
        param.install()
    state = ShardedUnit(cells, groups, mp, reshard_after_forward, strategy)
    for c in cells:
        object.__setattr__(c, STATE_ATTR, state)
        cls = type(c)
        if cls not in FSDP_CLASSES:
            FSDP_CLASSES[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
        c.__class__ = FSDP_CLASSES[cls]
    return cell
