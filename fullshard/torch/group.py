"""One communication group on torch: the parameters of one ``fully_shard`` call, their storage and collectives.

The lifecycle (``fullshard.core.group.Group``) decides when to gather, free, keep and reduce; this class
supplies torch's operations for it, carrying out the group's plan (``fullshard.plan.group``):

* gathering: every bucket's all-gather into owned storage (or from the chunks a partial reshard kept), the
  unsharded parameters registered on the modules once complete, freed or kept on reshard;
* gradients: autograd's, as its post-accumulate-grad hooks deliver them, summed in an owned accumulator while
  sync is off where the plan says so, reduced bucket by bucket, summed across HSDP replicas or kept as
  partial sums.

Which buffers are owned comes from the plan, never from the tensors.
"""
from __future__ import annotations

import functools
import os
import weakref
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from fullshard.core.group import Group
from fullshard.plan import Accumulation, Ownership, ReduceFacts, ReducePlan, ShardedGrad, Unsharded, plan_reduce
from fullshard.plan.exchange import EXCHANGE_ENV, TORCH, Collectives, Exchange, choose_exchange
from fullshard.plan.group import DEFAULT_FUSE_BELOW_NUMEL, AfterBackward, GroupPlan
from fullshard.torch import checks, collectives
from fullshard.torch.accumulation import accumulate_grad_in, carry_grad, hold_grad, take_carried_grad
from fullshard.torch.buckets import SoloCounts, all_reduce_in_place, gather_bucket, pack_rank_chunks, reduce_bucket
from fullshard.torch.collectives import Kind, Owned
from fullshard.torch.errors import NotMaterializedError
from fullshard.torch.extensions import ExtensionState, gather_extended
from fullshard.torch.param import ShardedParam, dtype_name, is_plain
from fullshard.torch.policies import TORCH_PROMOTES_REDUCE_DTYPE, TORCH_RUNTIME_FACTS, capture_grad_dtype_policy


class ParamGroup(Group):
    def __init__(
        self,
        params: list[ShardedParam],
        process_group: dist.ProcessGroup,
        reduce_dtype: Optional[torch.dtype],
        module_name: str,
        all_reduce: bool = False,
        after_backward: AfterBackward = AfterBackward.RESHARD,
        replicate_group: Optional[dist.ProcessGroup] = None,
        shard_mesh: Any = None,
        mp_policy: Any = None,
    ) -> None:
        self._reduce_grads = True
        super().__init__(after_backward)
        self.params = params
        self.process_group = process_group
        self.world = dist.get_world_size(process_group)
        # The traffic meter's key for this group's collectives: the mesh it shards (and replicates) over, so a
        # model on several meshes is measured per mesh (accounting.mesh_params names each mesh's parameters).
        self.mesh_key = "/".join(g.group_name for g in (process_group, replicate_group) if g is not None)
        # Replicated parameters (no_shard): nothing to gather, gradients all-reduced.
        self.replicated = all_reduce
        self._reduce_dtype = reduce_dtype
        # FSDPModule.set_custom_all_gather / set_custom_reduce_scatter (the plan uses them from then on)
        self.custom_all_gather: Any = None
        self.custom_reduce_scatter: Any = None
        # What all-gather extensions' pre hooks are told (FSDP2's arguments): the shard dim's 1-D mesh and the
        # policy (extensions.py).
        self.shard_mesh, self.mp_policy = shard_mesh, mp_policy
        # reshard_after_forward=k: after forward each rank keeps the chunks of W/k ranks, so backward gathers
        # within a group of k ranks only.
        self.post_forward_group: Optional[dist.ProcessGroup] = None
        self._post_forward_chunks: list[Owned] = []
        self._pending_gathers: list = []
        self._init_gradient_side(replicate_group)
        self._plan(module_name)

    def _init_gradient_side(self, replicate_group: Optional[dist.ProcessGroup]) -> None:
        # HSDP: shards are reduce-scattered within process_group, then summed across the replicas of
        # replicate_group (unless all_reduce_grads is off: partial sums then wait, owned, for a later backward).
        self.replicate_group = replicate_group
        self.replicas = dist.get_world_size(replicate_group) if replicate_group is not None else 1
        self._partials: dict[int, Owned] = {}
        # Whether gradient sync was off at some point since the last reduction (set alike on every rank):
        # gradients may then be fp32 accumulators, and must travel as such.
        self.accumulated_without_sync = False
        self.divide_factor: Optional[float] = None  # FSDPModule.set_gradient_divide_factor
        # Without one: the data-parallel size of the whole fully_shard call, which api.py sets for every group
        # (an expert mesh's own size is too small a divisor: plan.exchange.plan_mesh_groups).
        self.default_divide_factor: float = self.world * self.replicas
        self.all_reduce_hook: Optional[Callable[[torch.Tensor], None]] = None  # FSDPModule.set_all_reduce_hook
        self.all_reduce_hook_stream = None  # where the hook runs (None: the current stream)
        # Called after every accumulated gradient (the unit makes sure its root's end of backward will come).
        self.on_grad: Optional[Callable[[], None]] = None
        self._policies_read = False  # the parameters' grad_dtype policies, read again at the first forward

    @property
    def reduce_grads(self) -> bool:
        return self._reduce_grads

    @reduce_grads.setter
    def reduce_grads(self, value: bool) -> None:
        self._reduce_grads = value
        if not value:
            self.accumulated_without_sync = True

    # ------------------------------------------------------------------ plan
    def _plan(self, module_name: str) -> None:
        """Plan afresh (first, or parameters replaced, custom collectives set): unsharded tensors are rebuilt."""
        for param in self.params:
            # Planned afresh between micro-batches without sync (a parameter frozen, converted, replaced): what
            # autograd accumulated on the unsharded tensor, which is rebuilt, goes to the new one (accumulation.py).
            if param.unsharded is not None and param.unsharded.grad is not None:
                carry_grad(param)
            param.unsharded = param.unsharded_storage = None
        for handle in getattr(self, "_hooks", ()):
            handle.remove()
        self._hooks: list = []
        # The group's own exchange (gathers for a partial reshard and extensions use it, whatever the user's).
        self.exchange = choose_exchange(dist.get_backend(self.process_group), self.params[0].device.type,
                                        self.world, os.environ.get(EXCHANGE_ENV))
        collectives = Collectives(Exchange.CUSTOM if self.custom_all_gather is not None else self.exchange,
                                  Exchange.CUSTOM if self.custom_reduce_scatter is not None else self.exchange)
        reduce_dtype = dtype_name(self._reduce_dtype) if self._reduce_dtype is not None else None
        self.plan = GroupPlan(self.params, [p.facts for p in self.params], module_name, "module", reduce_dtype,
                              DEFAULT_FUSE_BELOW_NUMEL, collectives, TORCH, TORCH_RUNTIME_FACTS,
                              promote_grad_dtypes=TORCH_PROMOTES_REDUCE_DTYPE)
        for index, param in enumerate(self.params):
            converted = self.plan.accumulations[index] is Accumulation.CONVERTED_IN_AUTOGRAD
            param.held_grad_dtype = self.reduce_dtype(index) if converted else None
            # As FSDP2 2.15: widened only while accumulating, but for a tensor-parallel one (summed on its mesh first)
            param.defers_widening = converted and param.spec.unsharded is None and \
                self.reduce_dtype(index).itemsize > param.compute_dtype.itemsize
        self._held = [p for p in self.params if p.held_grad_dtype is not None]  # what backwards begin and end with
        # Outputs of lone all-gathers: the unsharded parameter is a view of them, so they live as long as the
        # plan and are reclaimed on reshard.
        self._view_outputs: list[Optional[Owned]] = [None] * len(self.plan.buckets)
        self._extensions: dict[int, ExtensionState] = {}  # bucket index -> what an extended parameter keeps

    def reduce_dtype(self, index: int) -> torch.dtype:
        """What parameter ``index``'s gradients are summed in."""
        return getattr(torch, self.plan.reduce_dtype(index))

    def replan(self) -> None:
        self.reshard()
        self._plan(self.module_name)

    def rename(self, module_fqn: str) -> None:
        self.plan.rename(module_fqn)

    @property
    def module_name(self) -> str:
        return self.plan.module_name

    @property
    def offloaded_to_host(self) -> bool:
        """Shards live in CPU memory while computing on an accelerator (copies may be in flight)."""
        return any(p.offloaded and p.device.type != "cpu" for p in self.params)

    def follow_replaced_params(self) -> bool:
        """Re-adopt parameters the user replaced (``to_empty``, ``.to(dtype)``, ``load_state_dict(assign=True)``);
        True if any was (the group was planned afresh)."""
        if any([param.refresh_from_module() for param in self.params]):
            self.replan()
            return True
        return False

    def refresh(self) -> None:
        """At a root forward: follow replaced parameters; parameters still on the meta device would be trained
        as garbage, so they are named (FSDP2's words)."""
        if not self._policies_read:  # as FSDP2 2.15's lazy init: a grad_dtype set after fully_shard counts
            self._policies_read = True
            if TORCH_PROMOTES_REDUCE_DTYPE and any(p.sharded._has_grad_dtype_override for p in self.params) \
                    and any([capture_grad_dtype_policy(p) for p in self.params]):
                self.replan()
        self.follow_replaced_params()
        meta = [p.fqn for p in self.params if p.sharded.device.type == "meta"]
        if meta:
            raise NotMaterializedError(
                "FSDP parameters should be materialized from meta device before training, but the following "
                f"were still on meta device: {meta}; call model.to_empty(device=...) and initialize them "
                "(e.g. fullshard.torch.materialize.materialize(model)) before the first forward"
            )

    # ------------------------------------------------------------------ gathering (core.group.Group)
    # Under torch.inference_mode the buffers gathered into would become inference tensors, which keep no
    # version counter and cannot be reused by a later training step: fullshard's own buffers never are.
    @torch.inference_mode(False)
    def _start_gather(self) -> None:
        chunks, self._post_forward_chunks = self._post_forward_chunks, []
        if chunks and self._shards_changed():
            collectives.release_all(chunks)  # the shards moved on: gather them afresh
        for param in self.params:
            param.gathered_version = param.shard_version()
        if self.replicated:
            self._unshard_replicated()
            return
        plan = self.plan
        for index, (bucket, gather) in enumerate(zip(plan.buckets, plan.gather_plans)):
            members = plan.members(index)
            if members[0].extended:
                state = self._extensions.setdefault(index, ExtensionState())
                self._pending_gathers.append(gather_extended(
                    members[0], state, self.process_group, self.shard_mesh, members[0].owners[0][0], self.mp_policy,
                    self.exchange, plan.labels[index], self.mesh_key,
                ))
                continue
            output = self._gather_output(index, members)
            if chunks:
                pending = gather_bucket(bucket, gather, members, output, self.post_forward_group, plan.labels[index],
                                        self.exchange, plan.gather_tags[index], kept=chunks[index], mesh=self.mesh_key)
            else:
                pending = gather_bucket(bucket, gather, members, output, self.process_group, plan.labels[index],
                                        plan.collectives.gather, plan.gather_tags[index], comm=self.custom_all_gather,
                                        mesh=self.mesh_key)
            self._pending_gathers.append(pending)

    def _unshard_replicated(self) -> None:
        """no_shard: the unsharded parameter is the replica itself, or an owned copy of it (``plan_replica``)."""
        for param, how in zip(self.params, self.plan.replica_plans):
            local = param.local_shard()
            if how is Unsharded.REPLICA:
                # Borrowed: the replica's own storage, never reclaimed. Made once per adoption of
                # the sharded parameter (a replaced one clears it: follow_replaced_params).
                if param.unsharded is None:
                    self._make_unsharded(param, local)
                continue
            if param.unsharded_storage is None:
                param.unsharded_storage = collectives.copy_of(
                    local, param.compute_dtype, param.device,
                    f"{dtype_name(param.compute_dtype)} copy of replica '{param.fqn}' of module '{self.module_name}'",
                    Kind.WORKING,
                )
                self._make_unsharded(param, param.unsharded_storage.tensor)
            else:
                param.unsharded_storage.regrow()
                target = param.unsharded_storage.writable("refresh the cast copy")
                with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(target):
                    target.copy_(local)

    def _gather_output(self, index: int, members: list[ShardedParam]) -> Owned:
        plan = self.plan
        bucket, gather = plan.buckets[index], plan.gather_plans[index]
        dtype, device = members[0].compute_dtype, members[0].device
        shards = [p.sharded._local_tensor for p in members]  # what the gather reads on this rank
        if gather.unsharded is Unsharded.VIEW_OF_OUTPUT:
            output = self._view_outputs[index]
            if output is None:
                output = collectives.allocate(
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
                param.unsharded_storage = collectives.allocate(
                    param.layout.shape, dtype, device,
                    f"unsharded parameter '{param.fqn}' of module '{plan.module_name}'", Kind.WORKING, shards,
                )
                self._make_unsharded(param, param.unsharded_storage.tensor)
            else:
                param.unsharded_storage.regrow()
        what = f"all-gather output of {plan.labels[index]}"
        if gather.output_pooled:
            return collectives.allocate_pooled(self.custom_all_gather, bucket.total_numel, dtype, device, what, shards)
        return collectives.allocate(bucket.total_numel, dtype, device, what, sources=shards)

    def _make_unsharded(self, param: ShardedParam, data: torch.Tensor) -> None:
        param.make_unsharded(data)
        if param.carried_grad is not None:
            take_carried_grad(param)
        if param.requires_grad:
            # The hook lives in C++ on the tensor, out of reach of Python's cycle collector: a strong
            # reference back to the group would keep the whole model alive forever once it is dropped.
            callback, index = weakref.WeakMethod(self._on_grad_accumulated), self.params.index(param)

            def on_grad_accumulated(_unsharded: torch.Tensor) -> None:
                method = callback()
                if method is not None:
                    method(index)

            self._hooks.append(param.unsharded.register_post_accumulate_grad_hook(on_grad_accumulated))

    @torch.inference_mode(False)
    def _finish_gather(self) -> None:
        pending, self._pending_gathers = self._pending_gathers, []
        for gather in pending:
            unsharded = gather.finish()
            if unsharded is not None:  # an extension's post hook built it, the first time
                self._make_unsharded(gather.param, unsharded)
        for param in self.params:
            param.register_unsharded()

    @torch.inference_mode(False)
    def _free(self, keep_post_forward_chunks: bool) -> None:
        """Free the unsharded storage (owned by fullshard; autograd's references stay valid objects)."""
        if keep_post_forward_chunks and self.post_forward_group is not None:
            self._keep_post_forward_chunks()
        for output in self._view_outputs:
            if output is not None and not output.is_reclaimed:
                output.reclaim()
        for param in self.params:
            if param.unsharded_storage is not None and not param.unsharded_storage.is_reclaimed:
                param.unsharded_storage.reclaim()
        for extension in self._extensions.values():
            extension.reclaim()
        self._keep()

    def _keep_post_forward_chunks(self) -> None:
        """reshard_after_forward=k: keep this rank's chunks for its post-forward group of k ranks."""
        plan = self.plan
        if self._extensions:
            raise NotImplementedError(
                f"reshard_after_forward=<int> with all-gather extensions (module '{plan.module_name}'): the "
                "extensions' hooks decide what is gathered, so the chunks cannot be kept for a smaller group; "
                "use reshard_after_forward=True or False"
            )
        group_size = dist.get_world_size(self.post_forward_group)
        span = self.world // group_size
        first = (dist.get_rank(self.process_group) % group_size) * span
        ranks = range(first, first + span)
        with torch.no_grad():
            for index, bucket in enumerate(plan.buckets):
                members = plan.members(index)
                kept = collectives.allocate(
                    span * bucket.chunk_numel, members[0].compute_dtype, members[0].device,
                    f"post-forward chunks of {plan.labels[index]}", sources=[p.unsharded_data for p in members],
                )
                pack_rank_chunks(kept.writable("keep chunks after forward"), bucket, members,
                                 [p.unsharded_data for p in members], ranks)
                self._post_forward_chunks.append(kept)

    def _keep(self) -> None:
        for param in self.params:
            param.register_sharded()

    def _shards_changed(self) -> bool:
        """Whether a shard was written through autograd since it was gathered (an optimizer step,
        ``load_state_dict``...): a kept copy is gathered again even inside an accumulation."""
        return any(p.shard_version() != p.gathered_version for p in self.params)

    def _drop_post_forward_chunks(self) -> None:
        collectives.release_all(self._post_forward_chunks)  # chunks from a forward whose backward never came

    def _abandon_gathers(self) -> None:
        """Let gathers in flight end. Storage a failed transfer may still be writing into is dropped, never
        resized, and rebuilt at the next gather."""
        pending, self._pending_gathers = self._pending_gathers, []
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
            self._drop_unsharded_storage()
            self._plan(self.module_name)
            self._keep()
        else:
            self._free(keep_post_forward_chunks=False)
        self._drop_post_forward_chunks()

    def _drop_unsharded_storage(self) -> None:
        for output in self._view_outputs:
            if output is not None:
                output.drop()
        for extension in self._extensions.values():
            for output in extension.outputs:
                output.drop()
        for param in self.params:
            if param.unsharded_storage is not None:
                param.unsharded_storage.drop()

    # ------------------------------------------------------------------ gradients (core.group.Group)
    def _on_grad_accumulated(self, index: int) -> None:
        """Autograd summed a gradient into an unsharded parameter."""
        param = self.params[index]
        if checks.finite:
            checks.inspect(param.fqn, param.local_grad(param.unsharded.grad))
        if not self.reduce_grads:  # accumulating without sync: sum in the reduce dtype (e.g. fp32 for bf16 compute)
            if self.plan.accumulations[index] is Accumulation.OWNED:
                accumulate_grad_in(param, self.reduce_dtype(index))
            elif self.plan.accumulations[index] is Accumulation.CONVERTED_IN_AUTOGRAD:
                hold_grad(param)
        if self.on_grad is not None:
            self.on_grad()

    def before_backward(self) -> None:
        for param in self._held:
            if param.requires_grad:
                param.before_backward(self.reduce_grads)

    def after_backward_pass(self) -> None:
        for param in self._held:
            param.hold_grad_dtype()

    def has_pending_grads(self) -> bool:
        """Some gradient arrived since the last reduction (read off the parameters, not tracked)."""
        return any(p.has_unreduced_grad() for p in self.params if p.requires_grad)

    def _start_reduce(self) -> list:
        """Start reducing every trainable bucket, on every rank alike, whichever gradients this rank holds (an
        owned zero stands in for a missing one): the ranks' collectives match by construction, and the presence
        counts (``plan.group.plan_presence``) leave a parameter no rank had a gradient for without one."""
        plan = self.plan
        divide = self.divide_factor if self.divide_factor is not None else self.default_divide_factor
        carried = next((b.solos for b in plan.reduce_buckets if b.solos), ())
        solos = [self.params[i] for i in (plan.counts_only.solos if plan.counts_only is not None else carried)]
        counts = SoloCounts(solos, [p.has_unreduced_grad() or self.reduce_unused_params for p in solos])
        pending = [self._reduce_bucket(index, divide, counts) for index in range(len(plan.buckets))]
        if plan.counts_only is not None:
            pending.append(self._reduce_counts(counts))
        pending = [reduction for reduction in pending if reduction is not None]
        # The reduction carrying the single buckets' counts finishes first (a stable sort): theirs read them.
        pending.sort(key=lambda reduction: not reduction.bucket.solos)
        self.accumulated_without_sync = False
        return pending

    def _reduce_counts(self, counts: SoloCounts) -> Any:
        """The group has no fused bucket to carry its single buckets' counts: they travel alone (a few elements,
        summed in the gradients' wire dtype, undivided), over the group's own exchange."""
        plan, bucket = self.plan, self.plan.counts_only
        first = bucket.solos[0]
        wire = getattr(torch, plan.wire_dtype(first, self.replicated, self.accumulated_without_sync))
        reduction = reduce_bucket(
            bucket, ReducePlan(Ownership.OWNED, Ownership.OWNED, ShardedGrad.COPY), [], [], wire, wire,
            self.process_group, 1, plan.counts_label, self.exchange, plan.counts_tag, all_reduce=self.replicated,
            solo_counts=counts, device=self.params[first].device, mesh=self.mesh_key,
        )
        if self.replicate_group is not None:  # HSDP: summed across the replicas, as the gradients are
            reduction.combine = functools.partial(self._sum_across_replicas, len(plan.buckets))
        return reduction

    def _reduce_bucket(self, index: int, divide: float, counts: SoloCounts) -> Any:
        plan = self.plan
        members = plan.members(index)
        if not members[0].requires_grad:
            return None
        grads = [p.take_unsharded_grad() for p in members]
        if self.reduce_unused_params:
            # FSDP2's set_reduce_scatter_unused_params: a missing gradient is reduced as a zero gradient of the
            # parameter, and every rank installs the result, even where no rank had one.
            grads = [g if g is not None else torch.zeros(p.layout.shape, dtype=p.compute_dtype, device=p.device)
                     for p, g in zip(members, grads)]
        present = [g for g in grads if g is not None]
        bucket = plan.reduce_buckets[index]
        first = bucket.members[0]
        reduce_dtype = self.reduce_dtype(first)
        wire = getattr(torch, plan.wire_dtype(first, self.replicated, self.accumulated_without_sync))
        reduction_plan = plan_reduce(bucket, plan.layouts, ReduceFacts(
            grad_dtype_is_wire_dtype=all(g.dtype == wire for g in present),
            # only a plain, contiguous gradient is a collective's buffer as it is (a subclass is packed)
            grads_contiguous=all(is_plain(g) and g.is_contiguous() for g in present),
            # every member's: a bucket joins parameters by stored and compute dtype, and their sharded gradient
            # dtypes may still differ (an explicit Tensor.grad_dtype on some of them)
            reduce_dtype_is_param_dtype=all(reduce_dtype == p.sharded_grad_dtype for p in members),
            all_reduce=self.replicated, offloaded=members[0].offloaded, exchange=plan.collectives.reduce,
            grads_present=len(present) == len(grads),
        ))
        reduction = reduce_bucket(
            bucket, reduction_plan, members, grads, reduce_dtype, wire, self.process_group, divide,
            plan.labels[index], plan.collectives.reduce, plan.reduce_tags[index], all_reduce=self.replicated,
            comm=self.custom_reduce_scatter, solo_counts=counts if bucket.solos or bucket.is_single else None,
            mesh=self.mesh_key,
        )
        reduction.hook, reduction.hook_stream = self.all_reduce_hook, self.all_reduce_hook_stream
        if self.replicate_group is not None:
            reduction.combine = functools.partial(self._sum_across_replicas, index)
        return reduction

    def _sum_across_replicas(self, index: int, output: Owned) -> bool:
        """HSDP: add any partial sum, then all-reduce across replicas or keep it for later."""
        partial = self._partials.pop(index, None)
        if partial is not None:
            with torch.no_grad():
                output.writable("add the partial gradient sum").add_(partial.tensor)
            partial.reclaim()
        if not self.all_reduce_grads:
            output.retag(Kind.MAIN_GRAD)  # kept across backward passes: gradient memory, not a transfer's
            self._partials[index] = output
            return False
        if self.replicas > 1:
            all_reduce_in_place(output, self.replicate_group, self.mesh_key)
        return True

    def _abandon_grads(self) -> None:
        """Forget this step's gradients: unreduced ones, HSDP partial sums and, as the installed FSDP2 does
        (2.15 on), the reduced sharded ones; 2.13 and 2.14 keep those. As in FSDP2, an accumulation in progress
        is lost with them."""
        for param in self.params:
            param.drop_grads(reduced=TORCH_PROMOTES_REDUCE_DTYPE)
        for partial in self._partials.values():
            partial.reclaim()
        self._partials.clear()
        self.accumulated_without_sync = not self.reduce_grads
