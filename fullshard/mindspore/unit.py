"""One unit on MindSpore: the Cell hooks that drive its lifecycle (``fullshard.core.lifecycle``), and its root's.

Where MindSpore (PyNative, inside ``value_and_grad``) tells a unit where it is in a step:

* forward pre-hook of the unit's first cell in a pass: the root's forward begins a step; gather
  (``Unit.pre_forward``) and show the tensors through each bucket's differentiable gather; the other cells of
  the unit show them too;
* forward hook of its last cell: ``Unit.post_forward`` (keep or reshard);
* backward pre-hook: ``Unit.pre_backward`` (gather again into the storage autograd saved), which also queues
  the end-of-backward callback;
* the last of its buckets' bprops for a backward (each hands over its gradients): ``Unit.post_backward``, so
  the unit's gradients are reduced together, with those of other units while their bytes stay below
  ``plan.layout.FUSE_REDUCTIONS_BELOW_BYTES``;
* MindSpore's final callback of the backward: ``Root.end_of_backward``.
"""
from __future__ import annotations

import threading
from functools import partial
from typing import Any, Iterator, Optional

from mindspore import Tensor, nn
from mindspore.communication import GlobalComm, get_group_size, get_rank

from fullshard.core.agreement import Ranks, check_ranks_agree, describe_model
from fullshard.core.lifecycle import Root, TrainingPhase, Unit
from fullshard.core.trees import map_leaves
from fullshard.core.units import named_under
from fullshard.mindspore.autograd import queue_after_backward, recording
from fullshard.mindspore.collectives import Comm, sum_floats
from fullshard.mindspore.group import ParamGroup, reduce_groups
from fullshard.mindspore.policies import FLOAT_DTYPES, MixedPrecisionPolicy
from fullshard.plan.layout import FUSE_REDUCTIONS_BELOW_BYTES
from fullshard.plan.strategy import Strategy

_active = threading.local()

class StepRoot(Root):
    fuse_reductions_below = FUSE_REDUCTIONS_BELOW_BYTES

    def _queue_end_of_backward(self) -> None:
        queue_after_backward(self.end_of_backward)

    def _reduce_groups(self, groups: list) -> list:
        reduce_groups(groups)  # the collectives complete when issued on MindSpore's CPU backend
        return []

    def _after_backward(self) -> None:
        for unit in self.units:
            unit.bprops_to_come = 0  # a bucket whose gradient did not reach it delivers nothing

    def reset_step(self) -> None:
        super().reset_step()
        self._after_backward()

    def check_ranks_agree(self, units: list) -> None:
        """Every rank compares the settings of ``units`` (``fullshard.core.agreement``)."""
        if not any(unit.groups for unit in units):
            return
        # Every mesh spans the world, and the world group is the one no setting can change: ranks that disagree,
        # even on the mesh, still meet there.
        world = Comm(GlobalComm.WORLD_COMM_GROUP, get_group_size(), get_rank())
        check_ranks_agree(
            describe_model(self, units, _unit_values, _group_values, _param_values),
            Ranks(partial(sum_floats, comm=world), world.rank, world.size),
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
        self._recorded = False  # this pass's forward is recorded for a gradient
        self.bprops_to_come = 0  # bucket bprops still to come for the recorded forwards
        for group in groups:
            group.on_delivered = self._on_delivered
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

    # ------------------------------------------------------------------ forward
    def _pre_forward(self, cell: nn.Cell, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        self.ensure_context()
        if self.is_root:
            self.enter_root_forward()
        if self.phase is not TrainingPhase.FORWARD:  # the first cell of this unit in this pass
            self._recorded = recording()
            self.pre_forward(prefetch=True)
            for group in self.groups:
                self.bprops_to_come += group.use_in_forward(self._recorded)
        else:
            for group in self.groups:
                group.show()
        dtype = self.mp_policy.param_dtype
        if dtype is not None and self.mp_policy.cast_forward_inputs:
            args, kwargs = _cast_floats(args, dtype), _cast_floats(kwargs, dtype)
        return args, kwargs

    def _post_forward(self, cell: nn.Cell, args: tuple, output: Any) -> Any:
        self.post_forward(cell, self._recorded, in_backward=False)
        if self.mp_policy.output_dtype is not None:
            output = _cast_floats(output, self.mp_policy.output_dtype)
        self.leave_root_forward()
        return output

    # ------------------------------------------------------------------ backward
    def _pre_backward(self, cell: nn.Cell, grad_output: Any) -> None:
        if self.context is not None:
            self.pre_backward()
        return None

    def _on_delivered(self) -> None:
        """A bucket's bprop handed over its gradients; after the unit's last one its backward is done."""
        self.bprops_to_come -= 1
        if self.bprops_to_come == 0:
            self.post_backward()


def _cast_floats(tree: Any, dtype: Any) -> Any:
    return map_leaves(lambda x: x.astype(dtype) if x.dtype in FLOAT_DTYPES and x.dtype != dtype else x, tree, Tensor)
