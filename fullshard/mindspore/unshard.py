"""The unsharding side of one group: gather, reshard, refill for backward, and when a kept copy is stale.

A group is SHARDED (its cells show the shards) or UNSHARDED (they may show
the unsharded tensors, whose storage fullshard owns). A forward recorded for
a gradient saves the unsharded tensors in autograd's graph; resharding
after forward frees their *storage* but keeps the tensor objects, and the
unit's backward pre-hook gathers into that storage again before backward
reads it (:meth:`Unsharder.refill_for_backward`), as FSDP2 does with
``resize_``. Which buffers are owned comes from the plan.

When is a kept unsharded copy still right? Only while nothing can have
written the shards since it was gathered, and MindSpore keeps no version
counter that an optimizer step moves. So a copy is kept from one root forward
to the next only while gradients accumulate without sync or after an
explicit ``unshard()``; every other step gathers afresh.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Optional

from mindspore import Tensor

from fullshard.mindspore import buffers
from fullshard.mindspore.autograd import no_grad
from fullshard.mindspore.buffers import Kind, Owned
from fullshard.mindspore.collectives import gather_bucket
from fullshard.mindspore.exchange import Comm
from fullshard.mindspore.group_plan import GroupPlan
from fullshard.mindspore.param import ShardedParam
from fullshard.mindspore.policies import dtype_name
from fullshard.plan import Unsharded


class GroupState(enum.Enum):
    SHARDED = "sharded"
    UNSHARDED = "unsharded"


@dataclass(eq=False)
class Gathered:
    """One gather of one bucket: the unsharded tensors (one per member) and the owned storage behind them."""

    index: int
    tensors: tuple[Tensor, ...]
    storage: list[Owned] = field(default_factory=list)  # empty: the tensors are the replicas themselves

    @property
    def reclaimed(self) -> bool:
        return any(s.is_reclaimed for s in self.storage)

    def reclaim(self) -> None:
        for owned in self.storage:
            if not owned.is_reclaimed:
                owned.reclaim()


class Unsharder:
    def __init__(self, params: list[ShardedParam], comm: Comm, replicated: bool) -> None:
        self.params = params
        self.comm = comm
        self.replicated = replicated  # no_shard / replicate_params: nothing to gather
        self.state = GroupState.SHARDED
        self.plan: GroupPlan
        self.current: list[Optional[Gathered]] = []
        # Gathers a recorded forward used, whose backward is still to come (refilled for it if freed).
        self.saved: list[Gathered] = []
        # Storage kept after a synced backward (ZeRO-1/2): gathered again at the next use.
        self._kept: list[Optional[Gathered]] = []
        # Set by an explicit FSDPModule.unshard(); the next forward of the unit uses that gather.
        self.requested = False

    def replan(self, plan: GroupPlan) -> None:
        self.plan = plan
        self.current = [None] * len(plan.buckets)
        self._kept = [None] * len(plan.buckets)

    # ------------------------------------------------------------------ gather
    def unshard(self) -> None:
        """Gather every bucket now, unless the cells already have an unsharded copy that is right."""
        if self.state is GroupState.UNSHARDED:
            return
        with no_grad():
            for index in range(len(self.plan.buckets)):
                self.current[index] = self._gather(index)
                kept, self._kept[index] = self._kept[index], None
                if kept is not None and kept not in self.saved:
                    kept.reclaim()  # the shards moved on since it was gathered
        self.state = GroupState.UNSHARDED

    def _gather(self, index: int) -> Gathered:
        if not self.replicated:
            storage = gather_bucket(self.plan, index, self.comm)
            return Gathered(index, tuple(s.tensor for s in storage), storage)
        # A replica is its own unsharded parameter: a view of it (borrowed), or an owned cast copy (plan_replica).
        tensors, storage = [], []
        for i in self.plan.buckets[index].members:
            param = self.params[i]
            if self.plan.replica_plans[i] is Unsharded.OWN_STORAGE:
                storage.append(buffers.adopt(
                    param.sharded.astype(param.compute_dtype),
                    f"{dtype_name(param.compute_dtype)} copy of replica '{param.fqn}' of cell '{self.plan.module_name}'",
                    (param.sharded,), Kind.WORKING,
                ))
                tensors.append(storage[-1].tensor)
            else:
                tensors.append(param.sharded.reshape(param.layout.shape))
        return Gathered(index, tuple(tensors), storage)

    def tensors(self, index: int) -> tuple[Tensor, ...]:
        """What bucket ``index``'s gather hands the forward (the group must be unsharded)."""
        gathered = self.current[index]
        if gathered is None:
            raise RuntimeError(f"internal error: {self.plan.labels[index]} is not gathered")
        return gathered.tensors

    def gathered_but_unused(self) -> bool:
        """Gathered (a prefetch) but used by no forward since, and not asked for with unshard()."""
        return (self.state is GroupState.UNSHARDED and not self.requested
                and not any(g is not None and g in self.saved for g in self.current))

    def save_for_backward(self) -> None:
        """A recorded forward used the current gathers: keep them until its backward is done."""
        for gathered in self.current:
            if gathered is not None and gathered not in self.saved:
                self.saved.append(gathered)

    def refill_for_backward(self) -> None:
        """Backward is about to read what a forward gathered: gather again into whatever was freed since."""
        with no_grad():
            for gathered in self.saved:
                if not gathered.reclaimed:
                    continue
                fresh = self._gather(gathered.index)
                for old, new in zip(gathered.storage, fresh.storage):
                    buffers.refill(old, new.tensor)
                fresh.reclaim()

    def show(self) -> None:
        """The cells' attributes show the unsharded tensors."""
        for gathered in self.current:
            if gathered is not None:
                for param, tensor in zip(self.plan.members(gathered.index), gathered.tensors):
                    param.show(tensor)

    def hide(self) -> None:
        for param in self.params:
            param.hide()

    # ------------------------------------------------------------------ reshard
    def reshard(self) -> None:
        """Free the unsharded storage and show the shards (tensors autograd saved stay valid objects)."""
        self.requested = False
        self.hide()
        for index, gathered in enumerate(self.current):
            if gathered is not None:
                gathered.reclaim()
            self.current[index] = None
        for index, kept in enumerate(self._kept):
            if kept is not None:
                kept.reclaim()
            self._kept[index] = None
        self.state = GroupState.SHARDED

    def mark_stale(self) -> None:
        """Show the shards but keep the storage; gather again before the next use (ZeRO-1/2)."""
        self.requested = False
        self.hide()
        for index, gathered in enumerate(self.current):
            if gathered is not None:
                self._kept[index] = gathered
            self.current[index] = None
        self.state = GroupState.SHARDED

    def release_saved(self) -> None:
        """The backward of the saved forwards is done: free their storage, unless it is still in use."""
        in_use = {id(g) for g in self.current + self._kept if g is not None}
        for gathered in self.saved:
            if id(gathered) not in in_use:
                gathered.reclaim()
        self.saved.clear()

    def begin_step(self, keep: bool) -> None:
        """A new root forward: forget unsharded copies an earlier step left, unless they are known right
        (``keep``, or an explicit unshard() since)."""
        if self.requested or keep:
            return
        if self.state is GroupState.UNSHARDED:
            self.mark_stale()

    def abandon(self) -> None:
        """The step raised: free everything gathered and show the shards."""
        self.reshard()
        self.release_saved()
