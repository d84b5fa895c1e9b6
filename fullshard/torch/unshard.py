"""The unsharding side of one group: all-gather, reshard (fully or partially), and when a kept copy is stale.

A group is SHARDED, UNSHARDING (all-gathers issued, not waited on) or
UNSHARDED. What the modules show follows that state, as in FSDP2: the
unsharded parameters (plain tensors) once a gather is complete, the sharded
DTensors again once resharded. Which buffers are owned comes from the plan.

When is a kept unsharded copy still right? Only while nothing can have
written the shards since it was gathered. Writes below autograd's version
counters (``p.data.copy_``, an EMA swap, ``dcp.load``) cannot be seen, so the
rule does not try to see them: a copy is kept from one root forward to the
next only while gradients accumulate without sync (no optimizer step can come
in between) or after an explicit ``unshard()``; every other step gathers
afresh (:meth:`Unsharder.begin_step`).
"""
from __future__ import annotations

import enum
import weakref
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from fullshard.plan import Unsharded
from fullshard.torch import buffers
from fullshard.torch.buffers import Kind, Owned
from fullshard.torch.collectives import PendingGather, gather_bucket, pack_rank_chunks
from fullshard.torch.extensions import ExtensionState, gather_extended
from fullshard.torch.group_plan import GroupPlan, dtype_name
from fullshard.torch.param import ShardedParam


class GroupState(enum.Enum):
    SHARDED = "sharded"
    UNSHARDING = "unsharding"  # all-gathers issued, not yet waited on
    UNSHARDED = "unsharded"


class Unsharder:
    def __init__(
        self,
        params: list[ShardedParam],
        process_group: dist.ProcessGroup,
        replicated: bool,
        on_grad_accumulated: Callable[[int], None],
        shard_mesh: Any = None,
        mp_policy: Any = None,
    ) -> None:
        self.params = params
        # What all-gather extensions' pre hooks are told (FSDP2's arguments): the shard dim's 1-D mesh
        # and the policy (see extensions.py).
        self.shard_mesh, self.mp_policy = shard_mesh, mp_policy
        self._extensions: dict[int, ExtensionState] = {}  # bucket index -> what an extended parameter keeps
        self.process_group = process_group
        self.replicated = replicated  # no_shard: nothing to gather, the replica is the unsharded parameter
        self._on_grad_accumulated = on_grad_accumulated
        self.state = GroupState.SHARDED
        self._pending: list[PendingGather] = []
        # reshard_after_forward=k: after forward each rank keeps the chunks of
        # W/k ranks, so backward gathers within a group of k ranks only.
        self.post_forward_group: Optional[dist.ProcessGroup] = None
        self._kept: list[Owned] = []
        # The next forward of the unit uses the gather as it is: set by an explicit FSDPModule.unshard(),
        # and by a backward that kept the parameters gathered (set_reshard_after_backward(False)).
        self.keep_for_next_forward = False
        self._hooks: list = []
        self.plan: GroupPlan
        # Outputs of lone all-gathers: the unsharded parameter is a view of them,
        # so they live as long as the group and are reclaimed on reshard.
        self._view_outputs: list[Optional[Owned]] = []

    def replan(self, plan: GroupPlan) -> None:
        """Take a new plan (first, or after parameters were replaced): unsharded tensors are rebuilt."""
        for param in self.params:
            param.unsharded = param.unsharded_storage = None
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        self.plan = plan
        self._view_outputs = [None] * len(plan.buckets)
        self._extensions = {}

    # ------------------------------------------------------------------ unshard
    # Under torch.inference_mode, the buffers gathered into would become inference
    # tensors, which keep no version counter and cannot be reused by a later
    # training step: fullshard's own buffers are always ordinary tensors.
    @torch.inference_mode(False)
    def unshard(self) -> None:
        """Issue the all-gathers (asynchronously); :meth:`wait_for_unshard` completes them."""
        if self.state is GroupState.UNSHARDED and self._shards_changed():
            self.mark_stale()
        if self.state is not GroupState.SHARDED:
            return
        kept, self._kept = self._kept, []
        if kept and self._shards_changed():
            buffers.release_all(kept)  # the shards moved on: gather them afresh
        for param in self.params:
            param.gathered_version = param.shard_version()
        if self.replicated:
            self._unshard_replicated()
            self._become_unsharded()
            return
        plan = self.plan
        device = self.params[0].device
        for index, (bucket, gather) in enumerate(zip(plan.buckets, plan.gather_plans)):
            members = plan.members(index)
            label, tag = plan.labels[index], plan.gather_tags[index]
            if members[0].extended:
                state = self._extensions.setdefault(index, ExtensionState())
                self._pending.append(gather_extended(
                    members[0], state, self.process_group, self.shard_mesh, members[0].owners[0][0], self.mp_policy,
                    plan.exchange, label,
                ))
                continue
            output = self._gather_output(index, device, members)
            if kept:
                pending = gather_bucket(
                    bucket, gather, members, output, self.post_forward_group, label, plan.exchange, tag,
                    kept=kept[index],
                )
            else:
                pending = gather_bucket(bucket, gather, members, output, self.process_group, label,
                                        plan.gather_exchange, tag, comm=plan.custom_all_gather)
            self._pending.append(pending)
        self.state = GroupState.UNSHARDING

    def _unshard_replicated(self) -> None:
        """no_shard: the unsharded parameter is the replica itself, or an owned copy of it (``plan_replica``)."""
        for param, how in zip(self.params, self.plan.replica_plans):
            local = param.local_shard()
            if how is Unsharded.REPLICA:
                # Borrowed: the replica's own storage, never reclaimed. Made once per adoption of
                # the sharded parameter (a replaced one clears it: ParamGroup.refresh_sharded).
                if param.unsharded is None:
                    self._make_unsharded(param, local)
                continue
            if param.unsharded_storage is None:
                param.unsharded_storage = buffers.copy_of(
                    local, param.compute_dtype, param.device,
                    f"{dtype_name(param.compute_dtype)} copy of replica '{param.fqn}' of module '{self.plan.module_name}'",
                    Kind.WORKING,
                )
                self._make_unsharded(param, param.unsharded_storage.tensor)
            else:
                param.unsharded_storage.regrow()
                target = param.unsharded_storage.writable("refresh the cast copy")
                with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(target):
                    target.copy_(local)

    def _gather_output(self, index: int, device: torch.device, members: list[ShardedParam]) -> Owned:
        plan = self.plan
        bucket, gather = plan.buckets[index], plan.gather_plans[index]
        dtype = members[0].compute_dtype
        shards = [p.sharded._local_tensor for p in members]  # what the gather reads on this rank
        if gather.unsharded is Unsharded.VIEW_OF_OUTPUT:
            output = self._view_outputs[index]
            if output is None:
                output = buffers.allocate(
                    bucket.total_numel, dtype, device, f"unsharded {plan.labels[index]}", Kind.WORKING, shards
                )
                self._view_outputs[index] = output
                param = members[0]
                self._make_unsharded(param, output.tensor[: param.layout.numel].view(param.layout.shape))
            else:
                output.regrow()
            return output
        for param in members:
            if param.unsharded_storage is None:
                param.unsharded_storage = buffers.allocate(
                    param.layout.shape, dtype, device,
                    f"unsharded parameter '{param.fqn}' of module '{plan.module_name}'", Kind.WORKING, shards,
                )
                self._make_unsharded(param, param.unsharded_storage.tensor)
            else:
                param.unsharded_storage.regrow()
        what = f"all-gather output of {plan.labels[index]}"
        if gather.output_pooled:
            return buffers.allocate_pooled(plan.custom_all_gather, bucket.total_numel, dtype, device, what, shards)
        return buffers.allocate(bucket.total_numel, dtype, device, what, sources=shards)

    def _make_unsharded(self, param: ShardedParam, data: torch.Tensor) -> None:
        param.make_unsharded(data)
        if param.requires_grad:
            # The hook lives in C++ on the tensor, out of reach of Python's cycle
            # collector: a strong reference back to the group would keep the
            # whole model alive forever once it is dropped.
            callback, index = weakref.WeakMethod(self._on_grad_accumulated), self.params.index(param)

            def on_grad_accumulated(_unsharded: torch.Tensor) -> None:
                method = callback()
                if method is not None:
                    method(index)

            self._hooks.append(param.unsharded.register_post_accumulate_grad_hook(on_grad_accumulated))

    @torch.inference_mode(False)
    def wait_for_unshard(self) -> None:
        if self.state is GroupState.UNSHARDING:
            pending, self._pending = self._pending, []
            for gather in pending:
                unsharded = gather.finish()
                if unsharded is not None:  # an extension's post hook built it, the first time
                    self._make_unsharded(gather.param, unsharded)
            self._become_unsharded()

    def _become_unsharded(self) -> None:
        self.state = GroupState.UNSHARDED
        for param in self.params:
            param.register_unsharded()

    # ------------------------------------------------------------------ reshard
    def reshard_after_forward(self) -> None:
        """Fully, or to the post-forward group when ``reshard_after_forward`` was an int."""
        if self.post_forward_group is not None:
            self.reshard_partially()
        else:
            self.reshard()

    @torch.inference_mode(False)
    def reshard_partially(self) -> None:
        """Keep this rank's chunks for its post-forward group, then free the unsharded storage."""
        self.wait_for_unshard()
        if self.state is GroupState.SHARDED:
            return
        plan = self.plan
        if self._extensions:
            raise NotImplementedError(
                f"reshard_after_forward=<int> with all-gather extensions (module '{plan.module_name}'): the "
                "extensions' hooks decide what is gathered, so the chunks cannot be kept for a smaller group; "
                "use reshard_after_forward=True or False"
            )
        group_size = dist.get_world_size(self.post_forward_group)
        world = dist.get_world_size(self.process_group)
        span = world // group_size
        first = (dist.get_rank(self.process_group) % group_size) * span
        ranks = range(first, first + span)
        with torch.no_grad():
            for index, bucket in enumerate(plan.buckets):
                members = plan.members(index)
                kept = buffers.allocate(
                    span * bucket.chunk_numel, members[0].compute_dtype, members[0].device,
                    f"post-forward chunks of {plan.labels[index]}", sources=[p.unsharded_data for p in members],
                )
                pack_rank_chunks(kept.writable("keep chunks after forward"), bucket, members,
                                 [p.unsharded_data for p in members], ranks)
                self._kept.append(kept)
        self.reshard()

    def reshard(self) -> None:
        """Free the unsharded storage (owned by fullshard; autograd's references stay valid objects)."""
        self.wait_for_unshard()
        self.keep_for_next_forward = False
        if self.state is GroupState.SHARDED:
            return
        for output in self._view_outputs:
            if output is not None:
                output.reclaim()
        for param in self.params:
            if param.unsharded_storage is not None:
                param.unsharded_storage.reclaim()
        for extension in self._extensions.values():
            extension.reclaim()
        self._become_sharded()

    def mark_stale(self) -> None:
        """Keep the unsharded storage but gather into it again before the next use (ZeRO-1/2)."""
        self.wait_for_unshard()
        self.keep_for_next_forward = False
        self._become_sharded()

    def _become_sharded(self) -> None:
        self.state = GroupState.SHARDED
        for param in self.params:
            param.register_sharded()

    def begin_step(self, keep: bool) -> None:
        """A new root forward: forget unsharded copies an earlier step left, unless they are known right
        (``keep``, or an explicit unshard() since)."""
        if self.keep_for_next_forward or keep:
            return
        if self.state is not GroupState.SHARDED:
            self.mark_stale()
        buffers.release_all(self._kept)  # chunks from a forward whose backward never came

    def _shards_changed(self) -> bool:
        """Whether a shard was written through autograd since it was gathered (an optimizer step,
        ``load_state_dict``...): a kept copy is gathered again even inside an accumulation."""
        return any(p.shard_version() != p.gathered_version for p in self.params)

    # ------------------------------------------------------------------ failures
    def abandon(self) -> None:
        """The step raised: let gathers in flight end, then reshard. Storage a failed transfer may
        still be writing into is dropped, never resized, and rebuilt at the next gather."""
        pending, self._pending = self._pending, []
        failed = False
        for gather in pending:
            try:
                unsharded = gather.finish()
                if unsharded is not None:
                    self._make_unsharded(gather.param, unsharded)
            except Exception:  # the step is abandoned either way; only the buffers' lifetime matters
                gather.abandon()
                failed = True
        if failed:
            for output in self._view_outputs:
                if output is not None:
                    output.drop()
            for extension in self._extensions.values():
                for output in extension.outputs:
                    output.drop()
            for param in self.params:
                if param.unsharded_storage is not None:
                    param.unsharded_storage.drop()
            self.replan(self.plan)
            self._become_sharded()
        else:
            if pending:
                self.state = GroupState.UNSHARDED
            self.reshard()
        buffers.release_all(self._kept)
