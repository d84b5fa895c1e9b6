"""``FSDPModule`` on torch: FSDP2's class, with the methods every runtime shares (``fullshard.core.module``) and
what torch has alone (gradient hooks on streams, custom collectives, post-optimizer events, ``_apply``)."""
from __future__ import annotations

import warnings
from typing import Any, Callable, Iterable

import torch
import torch.nn as nn
from torch.distributed import fsdp as torch_fsdp

# torch's own classes, taken once at import (see policies.py for why not at call time).
_TORCH_FSDP_MODULE = torch_fsdp.FSDPModule

from fullshard.core import module as core_module
from fullshard.core.module import FSDPModuleMethods
from fullshard.core.unit import UNIT_ATTR
from fullshard.torch.errors import DeepcopyError
from fullshard.torch.unit import ShardedUnit


# The dynamic subclass fully_shard gives each module class: FSDP<Orig>(FSDPModule, Orig).
FSDP_CLASSES: dict[type, type] = {}


class UnshardHandle(core_module.UnshardHandle, torch_fsdp.UnshardHandle):
    """Returned by ``unshard(async_op=True)``: ``wait()`` completes the all-gather (torch's type, for
    ``isinstance``)."""


class FSDPModule(FSDPModuleMethods, torch_fsdp.FSDPModule):
    """Mixin added to every module ``fully_shard`` was applied to (a dynamic subclass).

    It subclasses PyTorch's ``FSDPModule`` so that code finding FSDP modules with ``isinstance`` (torchtitan,
    accelerate, Lightning, torch's pipeline schedules) finds these too; every public method is defined here
    or in ``FSDPModuleMethods``, none is inherited from torch's. PyTorch's ``__new__`` is: constructing the class
    again (slicing an ``nn.Sequential``) gives the original class, as in FSDP2.
    """

    # Where PyTorch's __new__ finds the original class in the MRO:
    # [FSDP<Orig>, this class, FSDPModuleMethods, torch's FSDPModule, Orig, ...]
    _orig_cls_mro_index = 4
    unshard_handle = UnshardHandle

    def _modules_in_reach(self, recurse: bool) -> Iterable[nn.Module]:
        return self.modules() if recurse else [self]

    def _apply(self, *args: Any, **kwargs: Any) -> Any:
        # to_empty(), .to(), .float() ... replace sharded parameters or their data:
        # show the sharded ones first, then re-adopt what changed.
        self.reshard()
        # Past torch's FSDPModule (its _apply needs FSDP2 state) to the original class.
        result = super(_TORCH_FSDP_MODULE, self)._apply(*args, **kwargs)
        group = getattr(self, UNIT_ATTR).group
        if group is not None:
            group.follow_replaced_params()
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
        group = getattr(self, UNIT_ATTR).group
        if stream is not None and group is not None and group.replicate_group is not None:
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
        group = getattr(self, UNIT_ATTR).group
        if group is not None:
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


