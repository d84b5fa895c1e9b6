"""What both runtimes' ``fully_shard`` check before they change anything, written once.

Each check raises with a message that names the module (or cell) and the parameter, what is wrong and the
fix. A runtime passes its own exception type where its users' code expects one (torch's FSDP2 raises
``AssertionError`` subclasses in some places), and the words of its framework ("forward" or
"construct").
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Union

from fullshard.core.lifecycle import STATE_ATTR
from fullshard.plan.strategy import Strategy


def check_modules(modules: Sequence[Any], name: str, *, is_module: Callable[[Any], bool], kind: str,
                  is_container: Callable[[Any], bool], forward: str, word: str = "module",
                  applied_twice: type = ValueError) -> None:
    """Every module is a module of the framework (``kind``), not a container that is never called, and not
    sharded yet. ``word``: what the framework calls a module ("module", "cell")."""
    for module in modules:
        if not is_module(module):
            raise TypeError(f"fully_shard expects {kind}, got {type(module).__name__}")
        if is_container(module):
            raise ValueError(
                f"fully_shard does not support containers that do not implement {forward}: "
                f"{type(module).__name__} is never called, so its parameters would never be gathered; shard the "
                f"{word}s it holds, or pass them as a list to form one group: fully_shard(list(container), ...)"
            )
        if hasattr(module, STATE_ATTR):
            raise applied_twice(
                f"Each distinct composable distributed API can only be applied to a module once. fully_shard was "
                f"already applied to {name}; apply it once per {word} (children first, then parents)"
            )


def parse_strategy(strategy: Union[str, Strategy, None], name: str) -> Strategy:
    try:
        return Strategy.parse(strategy if strategy is not None else Strategy.OPTIM_GRADS_PARAMS)
    except ValueError as error:
        raise ValueError(f"fully_shard({name}): {error}") from None


def check_reshard_after_forward(value: Any, name: str, allow_int: bool) -> None:
    allowed = (bool, int) if allow_int else (bool,)
    if value is not None and not isinstance(value, allowed):
        choices = "True, False, None or an int (the size of the group to reshard to after forward)" if allow_int \
            else "True, False or None"
        raise ValueError(f"fully_shard({name}): reshard_after_forward={value!r} must be {choices}")


def check_not_managed(managed: bool, sharded_by_parent: bool, fqn: str, name: str) -> None:
    """A parameter some fully_shard call took over already would be sharded twice and silently untied."""
    if managed and sharded_by_parent:
        raise ValueError(
            f"fully_shard({name}): parameter '{fqn}' is already sharded by fully_shard on a parent module; apply "
            "fully_shard to children first, then to their parents"
        )
    if managed:
        raise ValueError(
            f"fully_shard({name}): parameter '{fqn}' is already managed by another fully_shard unit (it is shared "
            "with a module fully_shard was applied to); tied parameters must belong to one unit: apply fully_shard "
            "to their common parent only, or to both modules as one group: fully_shard([module_a, module_b])"
        )


def shard_dim(placement: Any, shard_type: type, shape: Sequence[int], fqn: str, name: str,
              out_of_range: type = ValueError) -> int:
    """The tensor dim ``shard_placement_fn``'s answer (``Shard(dim)`` or None: dim 0) cuts, negative dims
    counted from the end; a scalar cannot be cut on any dim."""
    if not shape:
        raise ValueError(
            f"fully_shard({name}): parameter '{fqn}' is a scalar and cannot be sharded. Change "
            f"{fqn.rpartition('.')[2]} to a 1D tensor with numel equal to 1, or pass it in ignored_params"
        )
    if placement is None:
        return 0
    if not isinstance(placement, shard_type):
        raise ValueError(
            f"fully_shard({name}): shard_placement_fn returned {placement!r} for '{fqn}'; it must return "
            "Shard(dim) or None"
        )
    ndim = len(shape)
    dim = placement.dim + ndim if placement.dim < 0 else placement.dim
    if not 0 <= dim < ndim:
        raise out_of_range(
            f"Shard dim {placement.dim} is invalid for {ndim}D tensor: fully_shard({name}): shard_placement_fn "
            f"returned Shard({placement.dim}) for '{fqn}' of shape {tuple(shape)}; the dim must be in "
            f"[-{ndim}, {ndim - 1}]"
        )
    return dim


def become_fsdp_module(module: Any, mixin: type, classes: dict[type, type], set_attr: Callable = setattr,
                       unit: Optional[Any] = None) -> None:
    """Give ``module`` its unit and the methods an FSDP module has: a dynamic subclass
    ``FSDP<Class>(mixin, Class)``, made once per class."""
    set_attr(module, STATE_ATTR, unit)
    cls = type(module)
    if cls not in classes:
        classes[cls] = type(f"FSDP{cls.__name__}", (mixin, cls), {})
    module.__class__ = classes[cls]
