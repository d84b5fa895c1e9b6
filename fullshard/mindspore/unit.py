"""One unit on MindSpore: the Cell hooks that drive its lifecycle (``fullshard.core.unit``), its root's, and
the ``FSDPModule`` class a sharded cell becomes (the methods every runtime shares, ``fullshard.core.module``,
with FSDP2's meanings, and the seed library's names MindSpore users call: ``set_reduce_op_type``, ``zero_grad``
of the main grads).

Where MindSpore (PyNative, inside ``value_and_grad``) tells a unit where it is in a step:

* forward pre-hook of the unit's first cell in a pass: the root's forward begins a step; gather
  (``Unit.pre_forward``) and show the tensors through the unit's differentiable gather (``group.UnitGather``);
  the other cells of the unit show them too;
* forward hook of its last cell: ``Unit.post_forward`` (keep or reshard);
* backward pre-hook: ``Unit.pre_backward`` (gather again into the storage autograd saved), which also queues
  the end-of-backward callback;
* the gather's bprop: every gradient of the unit's tensors is there; they are reduced in it and the unit's
  ``Unit.post_backward`` follows. The units that reduce at the end of backward (ZeRO-1, and units whose
  gradients may reach only some ranks: ``set_reduce_scatter_unused_params``) show their tensors through the
  root's gather instead, whose bprop comes after every use of them, on every rank;
* MindSpore's final callback of the backward: ``Root.end_of_backward``.
"""
from __future__ import annotations

import sys
import threading
from typing import Any, Iterable, Iterator, Optional

from mindspore import Tensor, nn

from fullshard.core.checks import check_ranks_agree, describe_model
from fullshard.core.module import FSDPModuleMethods, UnshardHandle  # noqa: F401 (UnshardHandle: public here)
from fullshard.core.unit import Root, TrainingPhase, Unit, named_under
from fullshard.core.trees import map_leaves
from fullshard.mindspore.autograd import drop_failed_recording, in_pynative_mode, queue_after_backward, recording
from fullshard.mindspore.group import ParamGroup, UnitGather, carried_by
from fullshard.mindspore.collectives import FLOAT_DTYPES, storage_copy_works, world_ranks
from fullshard.mindspore.policies import MixedPrecisionPolicy
from fullshard.plan.group import Strategy

_active = threading.local()

class StepRoot(Root):
    def __init__(self, root: "ShardedUnit") -> None:
        super().__init__(root)
        # The most bytes of unsharded gradients one reduction held in this step (what a memory report shows).
        self.peak_grads_in_backward = 0

    def _queue_end_of_backward(self) -> None:
        queue_after_backward(self.end_of_backward)

    def begin_step(self) -> None:
        self.peak_grads_in_backward = 0
        for group in self.groups:
            group.carried_outputs = None  # nodes of the last pass are done with
        super().begin_step()

    def check_ranks_agree(self, units: list) -> None:
        """Every rank compares the settings of ``units`` (``fullshard.core.checks``)."""
        if not any(unit.groups for unit in units):
            return
        # ranks that disagree, even on the mesh, still meet on the world group
        check_ranks_agree(
            describe_model(units, _unit_values, _group_values, _param_values), world_ranks(),
            "every rank must build the same model and apply fully_shard the same way",
        )


def _unit_values(unit: "ShardedUnit") -> dict[str, Any]:
    return {"apply_grad_on_fp32_main_grad": unit.mp_policy.apply_grad_on_fp32_main_grad}


def _group_values(group: ParamGroup) -> dict[str, Any]:
    replicas = group.replica.size if group.replica is not None else 1
    fuse, collectives = group.plan.fuse_below_numel, group.plan.collectives
    return {
        # sizes, not group names: the replicas' shard groups have names of their own
        "mesh": f"{replicas} replicas x {group.comm.size} shards",
        "exchange": f"all-gather {collectives.gather.value}, reduction {collectives.reduce.value}",
        "comm_fusion": f"True (below {fuse} elements per rank)" if fuse > 0 else False,
    }


def _param_values(param: Any) -> dict[str, Any]:
    return {"shape": param.layout.shape}


class ShardedUnit(Unit):
    root_class, active = StepRoot, _active
    # Without explicit targets, backward prefetches the unit it reaches next (gathers are synchronous on CPU:
    # issued early, they complete early; forward prefetch stays as it is set).
    implicit_forward_prefetch = False

    def __init__(
        self,
        cells: list[nn.Cell],
        groups: list[ParamGroup],
        mp_policy: MixedPrecisionPolicy,
        reshard_after_forward: Optional[bool],
        strategy: Strategy,
    ) -> None:
        super().__init__(groups, strategy, reshard_after_forward, len(cells))
        self.cells = cells
        self.mp_policy = mp_policy
        # The units whose tensors this unit's gather carries in this pass (its own, unless the root's carries
        # them; the root's, also those of every unit that reduces with it); fixed from the call to its bprop.
        self.carrying: list[ShardedUnit] = []
        self.gather = UnitGather(carried_by(self), self._reduced)
        for cell in cells:
            cell.register_forward_pre_hook(self._pre_forward, prepend=True, with_kwargs=True)
            # always_call: a forward that raises still restores the root marker
            cell.register_forward_hook(self._post_forward, always_call=True)
            cell.register_backward_pre_hook(self._pre_backward)

    @property
    def name(self) -> str:
        if self.groups:
            return self.groups[0].module_name
        return ", ".join(type(c).__name__ for c in self.cells)

    def _named_submodules(self) -> Iterator[tuple[str, nn.Cell]]:
        return named_under(self.cells, nn.Cell.cells_and_names)

    @property
    def reduces_with_root(self) -> bool:
        """Its gradients are reduced by the root's gather, after every use of them, on every rank alike: a
        unit that reduces at the end of backward (ZeRO-1, ``set_reduce_scatter_unused_params``)."""
        return self.is_root is False and (self.reduces_at_end_of_backward
                                          or any(g.reduce_unused_params for g in self.groups))

    def materialize(self) -> None:
        """fullshard's storage for this unit, anew (``FSDPModule.to_empty``: meta-device init)."""
        for group in self.groups:
            group.materialize()

    # ------------------------------------------------------------------ forward
    def _pre_forward(self, cell: nn.Cell, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        self.ensure_root()
        if self.is_root:
            self.root.check_not_in_backward(type(cell).__name__)  # a backward that raised: start clean
            self.enter_root_forward()
        if self.phase is not TrainingPhase.FORWARD:  # the first cell of this unit in this pass
            recorded = recording()
            self.pre_forward(prefetch=True)
            if recorded:
                self._show_through_gather()
        for group in self.groups:
            group.show()
        dtype = self.mp_policy.param_dtype
        if dtype is not None and self.mp_policy.cast_forward_inputs:
            args, kwargs = _cast_floats(args, dtype), _cast_floats(kwargs, dtype)
        return args, kwargs

    def _show_through_gather(self) -> None:
        """A recorded forward: the cells show the gather's outputs, so backward reaches its bprop. A unit the
        root's gather carries in this pass shows that one's; otherwise this unit's gather carries it (and, on
        the root, every unit that reduces with it), when any of its parameters wants a gradient."""
        if self.groups and self.groups[0].carried_outputs is not None:
            return  # the root's gather carries it, or this unit's carried an earlier use in this pass
        carrying = [self]
        if self.is_root:
            carrying += [unit for unit in self.root.units if unit.reduces_with_root]
        carrying = [unit for unit in carrying if any(g.requires_grad for g in unit.groups)]
        if not carrying:
            return
        self.carrying = carrying
        groups = [g for unit in carrying for g in unit.groups]
        outputs = self.gather(*[p.sharded for g in groups for p in g.in_bucket_order])
        outputs = (outputs,) if isinstance(outputs, Tensor) else tuple(outputs)
        for group in groups:
            group.carried_outputs, outputs = outputs[:len(group.params)], outputs[len(group.params):]

    def _post_forward(self, cell: nn.Cell, args: tuple, output: Any) -> Any:
        if sys.exc_info()[0] is not None:  # always_call: the forward raised, and the exception is on its way out
            self._abandon_forward()
            return output
        self.post_forward(cell, recording(), in_backward=False)
        if self.mp_policy.output_dtype is not None:
            output = _cast_floats(output, self.mp_policy.output_dtype)
        self.leave_root_forward()
        return output

    def _abandon_forward(self) -> None:
        """The root's forward raised: its step is abandoned (every unit shows its shards, nothing is kept for a
        backward that will not come), and so is what MindSpore recorded of it."""
        if self.root is None or self is not getattr(self.active, "unit", None):
            return
        recorded = recording()
        self.reset_step()
        if recorded:
            drop_failed_recording()

    # ------------------------------------------------------------------ backward
    def _pre_backward(self, cell: nn.Cell, grad_output: Any) -> None:
        if self.root is not None:
            self.pre_backward()
        return None

    def _reduced(self, units: list["ShardedUnit"], held_bytes: int) -> None:
        """The gather's bprop reduced these units' gradients: their backward for that use is done."""
        if self.root is not None:
            self.root.peak_grads_in_backward = max(self.root.peak_grads_in_backward, held_bytes)
        for unit in units:
            unit.post_backward()


def _cast_floats(tree: Any, dtype: Any) -> Any:
    return map_leaves(lambda x: x.astype(dtype) if x.dtype in FLOAT_DTYPES and x.dtype != dtype else x, tree, Tensor)


# ------------------------------------------------------------------------ the class a sharded cell becomes
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

    def to_empty(self, *, device: Optional[str] = None, recurse: bool = True) -> nn.Cell:
        """``Cell.to_empty`` (storage for the shards, left uninitialized), then fullshard's own buffers for every
        sharded cell in reach: the meta-device init of a model wrapped inside ``ms.DeviceCtx("meta")``. Fill the
        shards afterwards (``set_data``, ``load_checkpoint``)."""
        super().to_empty(device=device, recurse=recurse)
        storage_copy_works()  # a meta context may have broken MindSpore's storage copy (collectives.refill)
        for unit in self._units(recurse):
            unit.materialize()
        return self

    def zero_grad(self) -> None:
        """Zero every ``main_grad`` in reach (MixedPrecisionPolicy(apply_grad_on_fp32_main_grad=True))."""
        for unit in self._units(True):
            for group in unit.groups:
                for param in group.params:
                    param.zero_main_grad()


HSDPModule = FSDPModule

