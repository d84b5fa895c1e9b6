"""One communication group: the parameters of one ``fully_shard`` call, and its three parts.

* ``plan`` (:class:`~fullshard.torch.group_plan.GroupPlan`): buckets, exchange,
  labels and dtypes, from ``fullshard.plan``;
* ``unsharder`` (:class:`~fullshard.torch.unshard.Unsharder`): gather, reshard,
  what the modules show, when a kept copy is stale;
* ``reducer`` (:class:`~fullshard.torch.grads.GradReducer`): pending gradients,
  their reduction, HSDP partial sums.

What ties them is here: re-planning when the user replaced parameters.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from fullshard.plan.strategy import AfterBackward
from fullshard.torch.grads import GradReducer
from fullshard.torch.group_plan import GroupPlan
from fullshard.torch.param import ShardedParam
from fullshard.torch.unshard import GroupState, Unsharder


class ParamGroup:
    def __init__(
        self,
        params: list[ShardedParam],
        process_group: dist.ProcessGroup,
        reduce_dtype: Optional[torch.dtype],
        module_name: str,
        all_reduce: bool = False,
        after_backward: AfterBackward = AfterBackward.RESHARD,
        replicate_group: Optional[dist.ProcessGroup] = None,
        fuse_below_numel: Optional[int] = None,
        shard_mesh: Any = None,
        mp_policy: Any = None,
    ) -> None:
        self.params = params
        self.process_group = process_group
        self.world = dist.get_world_size(process_group)
        self.after_backward = after_backward
        # FSDPModule.set_unshard_in_backward(False): no backward op reads these parameters.
        self.unshard_in_backward = True
        self._reduce_dtype = reduce_dtype
        self._fuse_below_numel = fuse_below_numel
        # FSDPModule.set_custom_all_gather / set_custom_reduce_scatter (the plan uses them from then on)
        self.custom_all_gather: Any = None
        self.custom_reduce_scatter: Any = None
        self.reducer = GradReducer(params, process_group, self.world, all_reduce, replicate_group)
        self.unsharder = Unsharder(params, process_group, all_reduce, self.reducer.on_grad_accumulated,
                                   shard_mesh, mp_policy)
        self._plan(module_name)

    def _plan(self, module_name: str) -> None:
        self.plan = GroupPlan(
            self.params, self.process_group, self.world, self._reduce_dtype, module_name, self._fuse_below_numel,
            self.custom_all_gather, self.custom_reduce_scatter,
        )
        self.unsharder.replan(self.plan)
        self.reducer.plan = self.plan

    @property
    def module_name(self) -> str:
        return self.plan.module_name

    @property
    def state(self) -> GroupState:
        return self.unsharder.state

    @property
    def trainable(self) -> list[ShardedParam]:
        return [p for p in self.params if p.requires_grad]

    @property
    def offloaded_to_host(self) -> bool:
        """Shards live in CPU memory while computing on an accelerator (copies may be in flight)."""
        return any(p.offloaded and p.device.type != "cpu" for p in self.params)

    def refresh_sharded(self) -> None:
        """Follow parameters the user replaced; re-plan and drop unsharded copies if any changed."""
        changed = [param.refresh_from_module() for param in self.params]
        if any(changed):
            self.replan()

    def replan(self) -> None:
        """Plan afresh (parameters replaced, custom collectives set): unsharded copies are rebuilt."""
        self.unsharder.reshard()
        self._plan(self.module_name)
