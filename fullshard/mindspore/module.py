"""``FSDPModule``: the methods every cell ``fully_shard`` was applied to gains (FSDP2's and the seed library's names)."""
from __future__ import annotations

from typing import Any, Optional

from fullshard.core.lifecycle import distinct_units
from fullshard.core.units import configure_groups
from fullshard.mindspore.autograd import in_pynative_mode
from fullshard.mindspore.unit import ShardedUnit
from fullshard.plan.strategy import AfterBackward

# The dynamic subclass fully_shard gives each cell class: FSDP<Orig>(FSDPModule, Orig).
FSDP_CLASSES: dict[type, type] = {}


class UnshardHandle:
    """Returned by ``unshard(async_op=True)``. On CPU (mccl) every collective blocks, so the gather is
    already complete when the handle is returned; ``wait()`` is there for code written for Ascend."""

    def wait(self) -> None:
        return None


class FSDPModule:
    """Mixin added to every cell ``fully_shard`` was applied to (a dynamic subclass, as in FSDP2)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not in_pynative_mode():
            raise RuntimeError(
                f"{type(self).__name__} was wrapped by fully_shard, which runs in PyNative mode only; "
                "call ms.set_context(mode=ms.PYNATIVE_MODE) before calling it"
            )
        return super().__call__(*args, **kwargs)

    def _fullshard_states(self, recurse: bool) -> list[ShardedUnit]:
        return distinct_units([sub for _, sub in self.cells_and_names()] if recurse else [self])

    def _configure(self, recurse: bool, **values: Any) -> None:
        """Set ``values`` on every group in reach."""
        configure_groups(self._fullshard_states(recurse), values)

    def unshard(self, async_op: bool = False) -> Optional[UnshardHandle]:
        """Gather this cell's parameters now; until ``reshard()`` its attributes show the full tensors,
        and its forward runs on them."""
        state = self._fullshard_state
        for group in state.groups:
            group.unshard_now()
            group.show()
            group.held = True  # kept until reshard(), across forwards and steps
        return UnshardHandle() if async_op else None

    def reshard(self) -> None:
        """Free the unsharded parameters and show the shards again."""
        for group in self._fullshard_state.groups:
            group.reshard()

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, recurse: bool = True) -> None:
        """False: sum gradients locally (owned accumulators), no communication; the gradients returned
        meanwhile are zeros. The next backward with True reduces the sum."""
        self._configure(recurse, reduce_grads=bool(requires_gradient_sync),
                        all_reduce_grads=bool(requires_gradient_sync))

    def set_requires_all_reduce(self, requires_all_reduce: bool, recurse: bool = True) -> None:
        """HSDP: False keeps the reduced chunks as owned partial sums, without summing across replicas,
        until a backward with True (gradients returned meanwhile are zeros). No effect on a 1-D mesh."""
        self._configure(recurse, all_reduce_grads=bool(requires_all_reduce))

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(f"reshard_after_forward must be a bool, got {type(reshard_after_forward).__name__}")
        for state in self._fullshard_states(recurse):
            state.reshard_after_forward = reshard_after_forward

    def set_reshard_after_backward(self, reshard_after_backward: bool, recurse: bool = True) -> None:
        after = AfterBackward.RESHARD if reshard_after_backward else AfterBackward.KEEP_STORAGE
        self._configure(recurse, after_backward=after)

    def set_modules_to_forward_prefetch(self, modules: list[Any]) -> None:
        """Gather these cells' parameters right after this cell's, in forward."""
        self._fullshard_state.forward_prefetch = [_state_of(m, "set_modules_to_forward_prefetch") for m in modules]

    def set_modules_to_backward_prefetch(self, modules: list[Any]) -> None:
        """Gather these cells' parameters again right after this cell's, in backward."""
        self._fullshard_state.backward_prefetch = [_state_of(m, "set_modules_to_backward_prefetch") for m in modules]

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide this cell's reduced gradients by ``factor`` instead of the data-parallel size (1.0 gives a
        sum). Its own parameters only, as on torch (FSDP2): call it on every sharded cell to change them all."""
        if not factor > 0:
            raise ValueError(f"gradient divide factor must be > 0, got {factor}")
        self._configure(False, divide_factor=float(factor))

    def set_reduce_op_type(self, op: str) -> None:
        """"avg" (the default: the mean over data-parallel ranks) or "sum"."""
        if op not in ("avg", "sum"):
            raise ValueError(f"set_reduce_op_type: {op!r} is not 'avg' or 'sum'")
        self._configure(True, divide_factor=1.0 if op == "sum" else None)

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *, recurse: bool = True) -> None:
        """True: for units whose gradients may reach some ranks and not others in a step (an MoE expert that got
        no token on a rank, as its own unit).

        Their gradients are reduced by the root's gather, once every use of them is done, on every rank in the
        same order (a rank where no gradient reached them takes part with zeros), and they keep their parameters
        gathered from forward to the end of backward (a gather in backward would be a collective that the ranks
        without their backward never join). Parameters in a unit that always gets some gradient need nothing:
        the unit's gather reduces all of them, with zeros for the ones that got none on a rank.
        """
        self._configure(recurse, reduce_unused_params=bool(reduce_scatter_unused_params))

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Accepted for compatibility; nothing to do: every backward completes its reductions before
        ``value_and_grad`` returns."""

    def zero_grad(self) -> None:
        """Zero every ``main_grad`` in reach (MixedPrecisionPolicy(apply_grad_on_fp32_main_grad=True))."""
        for state in self._fullshard_states(True):
            for group in state.groups:
                for param in group.params:
                    param.zero_main_grad()

    def reset_iter_state(self) -> None:
        """After a forward or backward raised: drop gradients kept for later, reshard every unit (call on
        the root). A raise inside a bprop may still leave MindSpore's own state unusable (docs/mindspore.md)."""
        state = self._fullshard_state
        if state.context is not None:
            state.context.reset_step()
        else:
            state.reset_step()


HSDPModule = FSDPModule


def _state_of(cell: Any, caller: str) -> ShardedUnit:
    state = getattr(cell, "_fullshard_state", None)
    if state is None:
        raise ValueError(f"{caller}: {type(cell).__name__} is not an FSDPModule; apply fully_shard to it first")
    return state
