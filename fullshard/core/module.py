"""The methods a module or cell gains from ``fully_shard``, written once for both runtimes.

:class:`FSDPModuleMethods` holds the methods with one meaning on both runtimes (FSDP2's); each runtime's
``FSDPModule`` adds only what its framework has alone, and says so.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterable, Iterator, Optional

from fullshard.core.unit import UNIT_ATTR, Unit, distinct_units
from fullshard.plan.group import AfterBackward


def unit_of(module: Any, caller: str) -> Unit:
    unit = getattr(module, UNIT_ATTR, None)
    if unit is None:
        raise ValueError(f"{caller}: {type(module).__name__} is not an FSDPModule; apply fully_shard to it first")
    return unit


# ---------------------------------------------------------------------------------------------- the methods
class UnshardHandle:
    """Returned by ``unshard(async_op=True)``: ``wait()`` completes the gathers, which the next forward uses."""

    def __init__(self, unit: Optional[Unit]) -> None:
        self._unit = unit

    def wait(self) -> None:
        if self._unit is not None:
            for group in self._unit.groups:
                group.keep_for_next_forward()  # the modules show the unsharded parameters now
        self._unit = None


class FSDPModuleMethods:
    """The methods every module (cell) ``fully_shard`` was applied to gains, with FSDP2's meaning, on both
    runtimes. A runtime's ``FSDPModule`` lists its modules (``_modules_in_reach``) and its handle class."""

    unshard_handle = UnshardHandle

    def _modules_in_reach(self, recurse: bool) -> Iterable[Any]:
        """This module and, with ``recurse``, every module below it."""
        raise NotImplementedError

    def _units(self, recurse: bool) -> list[Unit]:
        return distinct_units(self._modules_in_reach(recurse))

    def _configure(self, recurse: bool, **values: Any) -> None:
        """Set ``values`` on every group in reach."""
        for unit in self._units(recurse):
            for group in unit.groups:
                for name, value in values.items():
                    setattr(group, name, value)

    def unshard(self, async_op: bool = False) -> Optional[UnshardHandle]:
        """Gather this module's parameters now (e.g. to prefetch); the modules show them, and the next forward
        uses them as they are (while the shards do not change)."""
        unit = getattr(self, UNIT_ATTR)
        for group in unit.groups:
            group.unshard()
        handle = self.unshard_handle(unit)
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        """Free the unsharded parameters and show the shards again."""
        for group in getattr(self, UNIT_ATTR).groups:
            group.reshard()

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """False: sum gradients locally, no communication (FSDP1's ``no_sync``); the next backward with True
        reduces the sum."""
        self._configure(recurse, reduce_grads=bool(requires_gradient_sync),
                        all_reduce_grads=bool(requires_gradient_sync))

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Context manager form of ``set_requires_gradient_sync(False)``."""
        self.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.set_requires_gradient_sync(True)

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: False keeps the reduced chunks as owned partial sums, without the replica all-reduce, until a
        backward with True. No effect on a 1-D mesh, which has no replicas."""
        self._configure(recurse, all_reduce_grads=bool(requires_all_reduce))

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(f"reshard_after_forward must be a bool, got {type(reshard_after_forward).__name__}")
        for unit in self._units(recurse):
            unit.reshard_after_forward = reshard_after_forward

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """False keeps the parameters gathered after backward for the next forward, which uses them while the
        shards do not change (FSDP2's meaning)."""
        after = AfterBackward.RESHARD if reshard_after_backward else AfterBackward.KEEP_GATHERED
        self._configure(recurse, after_backward=after)

    def set_modules_to_forward_prefetch(self, modules: list[Any]) -> None:
        """Start these modules' gathers right after this module's, in forward."""
        getattr(self, UNIT_ATTR).forward_prefetch = [unit_of(m, "set_modules_to_forward_prefetch") for m in modules]

    def set_modules_to_backward_prefetch(self, modules: list[Any]) -> None:
        """Start these modules' gathers right after this module's, in backward."""
        getattr(self, UNIT_ATTR).backward_prefetch = [unit_of(m, "set_modules_to_backward_prefetch") for m in modules]

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide this module's reduced gradients by ``factor`` instead of the data-parallel size (1.0 gives a
        sum). Its own parameters only, as in FSDP2: call it on every sharded module to change them all."""
        if not factor > 0:
            raise ValueError(f"gradient divide factor must be > 0, got {factor}")
        self._configure(False, divide_factor=float(factor))

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Accepted for FSDP2 compatibility; nothing to do: every backward already completes its reductions
        and keeps no prefetch state across backward passes."""

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """False: do not gather this module's parameters for backward, because no backward op reads them (e.g.
        an embedding, whose weight gradient needs only the indices)."""
        self._configure(False, unshard_in_backward=bool(unshard_in_backward))

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *, recurse: bool = True) -> None:
        """True: for units whose gradients may reach some ranks and not others in a step (conditional branches,
        a mixture of experts whose experts are units of their own).

        Such a unit reduces at the end of backward, in module order on every rank (a rank where no gradient
        arrived takes part with zeros), keeps its parameters gathered from forward to the end of backward (a
        gather in backward would be a collective that the ranks without that backward never join), and its
        parameters get a gradient (zero where no rank had one). Parameters that share a bucket or a unit with
        parameters every rank has gradients for need nothing: their bucket is reduced on every rank anyway.
        """
        self._configure(recurse, reduce_unused_params=bool(reduce_scatter_unused_params))

    def reset_iter_state(self) -> None:
        """Abandon the step in flight: drop its pending reductions and gradients, reshard every unit (call on
        the root). Not needed after a forward or backward that raised: the next forward starts clean."""
        unit = getattr(self, UNIT_ATTR)
        if unit.is_root is False:  # it would abandon the root's whole step, reduced gradients included
            raise RuntimeError("reset_iter_state must be called on the root FSDP module")  # FSDP2's words
        unit.reset_step()
