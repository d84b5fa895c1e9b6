"""``FSDPModule`` on MindSpore: the methods every runtime shares (``fullshard.core.module``, FSDP2's meanings),
and the seed library's names MindSpore users call (``set_reduce_op_type``, ``zero_grad`` of the main grads)."""
from __future__ import annotations

from typing import Any, Iterable

from fullshard.core.module import FSDPModuleMethods, UnshardHandle  # noqa: F401 (UnshardHandle: public here)
from fullshard.mindspore.autograd import in_pynative_mode

# The dynamic subclass fully_shard gives each cell class: FSDP<Orig>(FSDPModule, Orig).
FSDP_CLASSES: dict[type, type] = {}


class FSDPModule(FSDPModuleMethods):
    """Mixin added to every cell ``fully_shard`` was applied to (a dynamic subclass, as in FSDP2).

    On CPU (mccl) every collective blocks: ``unshard(async_op=True)`` returns with the gather complete, and the
    handle's ``wait()`` is there for code written for Ascend. Without version counters to see an optimizer
    step, parameters kept gathered (``unshard()``, ``set_reshard_after_backward(False)``) are gathered again
    after every backward that reduced (MindSpore steps the optimizer on its returned gradients then).
    """

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not in_pynative_mode():
            raise RuntimeError(
                f"{type(self).__name__} was wrapped by fully_shard, which runs in PyNative mode only; "
                "call ms.set_context(mode=ms.PYNATIVE_MODE) before calling it"
            )
        return super().__call__(*args, **kwargs)

    def _modules_in_reach(self, recurse: bool) -> Iterable[Any]:
        return [sub for _, sub in self.cells_and_names()] if recurse else [self]

    def set_reduce_op_type(self, op: str) -> None:
        """"avg" (the default: the mean over data-parallel ranks) or "sum" (the seed library's name; the same as
        ``set_gradient_divide_factor(1.0)`` on every sharded cell in reach)."""
        if op not in ("avg", "sum"):
            raise ValueError(f"set_reduce_op_type: {op!r} is not 'avg' or 'sum'")
        self._configure(True, divide_factor=1.0 if op == "sum" else None)

    def zero_grad(self) -> None:
        """Zero every ``main_grad`` in reach (MixedPrecisionPolicy(apply_grad_on_fp32_main_grad=True))."""
        for unit in self._units(True):
            for group in unit.groups:
                for param in group.params:
                    param.zero_main_grad()


HSDPModule = FSDPModule


__all__ = ["FSDPModule", "FSDP_CLASSES", "HSDPModule", "UnshardHandle"]
