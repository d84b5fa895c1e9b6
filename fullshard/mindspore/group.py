"""One communication group: the parameters of one ``fully_shard`` call (sharded or replicated), and its parts.

* ``plan`` (:class:`~fullshard.mindspore.group_plan.GroupPlan`): buckets, collectives, labels, dtypes;
* ``unsharder`` (:class:`~fullshard.mindspore.unshard.Unsharder`): gather, reshard, refill;
* ``reducer`` (:class:`~fullshard.mindspore.grads.GradReducer`): what each bucket's bprop does;
* one differentiable gather per bucket (:class:`BucketGather`), whose forward hands the cells the
  unsharded tensors and whose bprop reduces their gradients and returns this rank's shards of them:
  ``value_and_grad`` over the shards then returns sharded gradients by itself.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Optional

from mindspore import Tensor, nn

from fullshard.mindspore.autograd import recording
from fullshard.mindspore.exchange import Comm
from fullshard.mindspore.grads import GradReducer
from fullshard.mindspore.group_plan import GroupPlan
from fullshard.mindspore.param import ShardedParam
from fullshard.mindspore.unshard import GroupState, Unsharder
from fullshard.plan.backends import Backend, Collectives


class BucketGather(nn.Cell):
    """All-gather of one bucket as a Cell with a custom bprop.

    MindSpore runs a custom-bprop Cell's ``construct`` without recording it,
    so the gather itself is not differentiated; ``bprop`` receives the
    gradients of the unsharded tensors (borrowed from autograd) and returns
    one gradient per shard, which is what ``value_and_grad`` hands out for
    the shard Parameters.
    """

    def __init__(self, group: "ParamGroup", index: int) -> None:
        super().__init__()
        # Not a Cell attribute of the model: kept outside its tree, and weakly, so the model owns the group.
        self._group = weakref.ref(group)
        self._index = index

    def construct(self, *shards: Tensor) -> tuple[Tensor, ...]:
        return self._group().unsharder.tensors(self._index)

    def bprop(self, *args: Any) -> tuple[Tensor, ...]:
        douts = args[-1]
        return self._group().on_bucket_grads(self._index, (douts,) if isinstance(douts, Tensor) else tuple(douts))


class ParamGroup:
    def __init__(
        self,
        params: list[ShardedParam],
        comm: Comm,
        replica: Optional[Comm],
        reduce_dtype: Optional[Any],
        module_name: str,
        collectives: Collectives,
        backend: Backend,
        fuse_below_numel: int,
        replicated: bool = False,
        reshard_after_backward: bool = True,
    ) -> None:
        self.params = params
        self.comm = comm
        self.replicated = replicated
        for param in params:
            param.group = self
        self.reshard_after_backward = reshard_after_backward
        self.reducer = GradReducer(params, comm, replica, all_reduce=replicated)
        self.unsharder = Unsharder(params, comm, replicated)
        self.plan = GroupPlan(params, reduce_dtype, module_name, fuse_below_numel, collectives, backend)
        self.unsharder.replan(self.plan)
        self.reducer.plan = self.plan
        self.gathers = [BucketGather(self, index) for index in range(len(self.plan.buckets))]
        # Set by the unit: called after each bucket's bprop reduced (it counts them to reshard after backward).
        self.on_bucket_reduced: Optional[Callable[[], None]] = None

    @property
    def module_name(self) -> str:
        return self.plan.module_name

    @property
    def state(self) -> GroupState:
        return self.unsharder.state

    def gather_for_forward(self) -> None:
        """Gather (unless the cells hold a right copy already) and show every bucket through its
        differentiable gather, so that a recorded forward's backward reaches the bprops."""
        self.unsharder.unshard()
        for index, gather in enumerate(self.gathers):
            members = self.plan.members(index)
            outputs = gather(*[p.sharded for p in members])
            for param, tensor in zip(members, (outputs,) if isinstance(outputs, Tensor) else outputs):
                param.show(tensor)
        if recording():
            self.unsharder.save_for_backward()

    def on_bucket_grads(self, index: int, grads: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        shard_grads = self.reducer.reduce(index, grads)
        if self.on_bucket_reduced is not None:
            self.on_bucket_reduced()
        return shard_grads
