"""One communication group: the parameters of one ``fully_shard`` call.

The group moves between two states, SHARDED and UNSHARDED (with a pending
all-gather in between), and turns the unsharded gradients into sharded ones
after backward. Which buffers are owned comes from ``fullshard.plan``.
"""
from __future__ import annotations

import enum
import functools
import os
import weakref
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from fullshard.torch import buffers
from fullshard.torch.buffers import Owned
from fullshard.plan import (
    Unsharded, choose_exchange, exchange_tag, plan_buckets, plan_gather, plan_reduce, wire_dtype,
)
from fullshard.plan.exchange import EXCHANGE_ENV
from fullshard.torch.collectives import (
    PendingGather,
    PendingReduce,
    all_reduce_in_place,
    gather_bucket,
    pack_rank_chunks,
    reduce_bucket,
)
from fullshard.torch import checks
from fullshard.torch.param import ShardedParam

# Parameters whose per-rank chunk has fewer elements than this share one
# collective (fusion); larger ones are gathered straight into their own storage.
DEFAULT_FUSE_BELOW_NUMEL = 1 << 16


def _dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16": how the planning code names dtypes."""
    return str(dtype).removeprefix("torch.")


class GroupState(enum.Enum):
    SHARDED = "sharded"
    UNSHARDING = "unsharding"  # all-gathers issued, not yet waited on
    UNSHARDED = "unsharded"


class ParamGroup:
    def __init__(
        self,
        params: list[ShardedParam],
        process_group: dist.ProcessGroup,
        reduce_dtype: Optional[torch.dtype],
        module_name: str,
        all_reduce: bool = False,
        reshard_after_backward: bool = True,
        replicate_group: Optional[dist.ProcessGroup] = None,
        fuse_below_numel: Optional[int] = None,
    ) -> None:
        self.params = params
        # Replicated parameters (no_shard): nothing to gather, gradients all-reduced.
        self.all_reduce = all_reduce
        self.process_group = process_group
        self.world = dist.get_world_size(process_group)
        # HSDP: shards are reduce-scattered within process_group, then summed
        # across the replicas of replicate_group (unless all_reduce_grads is off,
        # when the partial sums wait in owned buffers for the final micro-batch).
        self.replicate_group = replicate_group
        self.replicas = dist.get_world_size(replicate_group) if replicate_group is not None else 1
        self.all_reduce_grads = True
        self._partials: dict[int, Owned] = {}
        # reshard_after_forward=k: after forward each rank keeps the chunks of
        # W/k ranks, so backward gathers within a group of k ranks only.
        self.post_forward_group: Optional[dist.ProcessGroup] = None
        self._kept: list[Owned] = []
        self.module_name = module_name
        self._reduce_dtype = reduce_dtype
        self._fuse_below_numel = DEFAULT_FUSE_BELOW_NUMEL if fuse_below_numel is None else fuse_below_numel
        self._plan()
        self.state = GroupState.SHARDED
        self._pending_gathers: list[PendingGather] = []
        self._reduce_grads = True
        # Whether gradient sync was off at some point since the last reduction
        # (set_requires_gradient_sync / no_sync, called alike on every rank):
        # gradients may then be fp32 accumulators, and must travel as such.
        self.accumulated_without_sync = False
        self.reshard_after_backward = reshard_after_backward
        self.divide_factor: Optional[float] = None
        # FSDPModule controls: see set_unshard_in_backward, set_reduce_scatter_unused_params, set_all_reduce_hook.
        self.unshard_in_backward = True
        self.reduce_unused_params = False
        self.all_reduce_hook: Optional[Callable[[torch.Tensor], None]] = None
        self.ran_forward = False  # since the last backward: with reduce_unused_params, it reduces in backward
        self.shown_for_backward = False  # the module shows the unsharded parameters for its backward
        self._grads_ready: set[int] = set()
        self.backward_done = False
        self._hooks: list = []

    def _plan(self) -> None:
        """Buckets and ownership plans from the parameters' current shapes and dtypes."""
        params = self.params
        layouts = tuple(p.layout for p in params)
        # Only parameters of the same dtypes and trainability share a buffer.
        kinds = tuple((p.stored_dtype, p.compute_dtype, p.requires_grad) for p in params)
        self.buckets = plan_buckets(layouts, self._fuse_below_numel, kinds)
        self.exchange = choose_exchange(
            dist.get_backend(self.process_group), params[0].device.type, self.world, os.environ.get(EXCHANGE_ENV)
        )
        self.gather_plans = [
            plan_gather(b, layouts, cast_needed=params[b.members[0]].converts_for_compute, exchange=self.exchange)
            for b in self.buckets
        ]
        self._name_buckets()
        # Outputs of lone all-gathers: the unsharded parameter is a view of them,
        # so they live as long as the group and are reclaimed on reshard.
        self._view_outputs: list[Optional[Owned]] = [None] * len(self.buckets)

    def rename(self, module_fqn: str) -> None:
        """Name the group's parameters by their path from the root module (known at lazy init)."""
        if self.module_name == module_fqn or not module_fqn:
            return
        for param in self.params:
            param.fqn = f"{module_fqn}.{param.local_fqn}"
        self.module_name = module_fqn
        self._name_buckets()

    def _name_buckets(self) -> None:
        """Labels for messages, and the point-to-point tags derived from them (the same on every rank)."""
        self.labels = [self._label(b.members) for b in self.buckets]
        self.gather_tags = [exchange_tag(label, "all_gather") for label in self.labels]
        self.reduce_tags = [exchange_tag(label, "reduce_scatter") for label in self.labels]

    def _label(self, members: tuple[int, ...]) -> str:
        names = ", ".join(self.params[i].fqn for i in members[:3])
        more = f" and {len(members) - 3} more" if len(members) > 3 else ""
        return f"[{names}{more}] of module '{self.module_name}'"

    @property
    def trainable(self) -> list[ShardedParam]:
        return [p for p in self.params if p.requires_grad]

    def reduce_dtype(self, param: ShardedParam) -> torch.dtype:
        return self._reduce_dtype or param.compute_dtype

    # ------------------------------------------------------------------ unshard / reshard
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
        if self.all_reduce:
            self._unshard_replicated()
            self.state = GroupState.UNSHARDED
            return
        device = self.params[0].device
        for index, (bucket, plan) in enumerate(zip(self.buckets, self.gather_plans)):
            members = [self.params[i] for i in bucket.members]
            output = self._gather_output(index, device, members)
            label, tag = self.labels[index], self.gather_tags[index]
            if kept:
                pending = gather_bucket(
                    bucket, plan, members, output, self.post_forward_group, label, self.exchange, tag, kept=kept[index]
                )
            else:
                pending = gather_bucket(bucket, plan, members, output, self.process_group, label, self.exchange, tag)
            self._pending_gathers.append(pending)
        self.state = GroupState.UNSHARDING

    def _unshard_replicated(self) -> None:
        """no_shard: the unsharded parameter is the replica itself, or an owned cast of it."""
        for param in self.params:
            local = param.local_shard()
            if not param.converts_for_compute:
                if param.unsharded is None or param.unsharded.untyped_storage()._cdata != local.untyped_storage()._cdata:
                    self._make_unsharded(param, local)  # borrowed: the replica's own storage, never reclaimed
                continue
            if param.unsharded_storage is None:
                param.unsharded_storage = buffers.adopt(
                    local.to(param.device, param.compute_dtype),
                    f"{param.compute_dtype} copy of '{param.fqn}' of module '{self.module_name}'", working=True,
                )
                self._make_unsharded(param, param.unsharded_storage.tensor)
            else:
                param.unsharded_storage.regrow()
                target = param.unsharded_storage.writable("refresh the cast copy")
                with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(target):
                    target.copy_(local)

    def _gather_output(self, index: int, device: torch.device, members: list[ShardedParam]) -> Owned:
        bucket, plan = self.buckets[index], self.gather_plans[index]
        dtype = members[0].compute_dtype
        if plan.unsharded is Unsharded.VIEW_OF_OUTPUT:
            output = self._view_outputs[index]
            if output is None:
                output = buffers.allocate(
                    bucket.total_numel, dtype, device, f"unsharded {self.labels[index]}", working=True
                )
                self._view_outputs[index] = output
                param = members[0]
                data = output.tensor[: param.layout.numel].view(param.layout.shape)
                self._make_unsharded(param, data)
            else:
                output.regrow()
            return output
        for param in members:
            if param.unsharded_storage is None:
                param.unsharded_storage = buffers.allocate(
                    param.layout.shape, dtype, device, f"unsharded parameter '{param.fqn}' of module '{self.module_name}'",
                    working=True,
                )
                self._make_unsharded(param, param.unsharded_storage.tensor)
            else:
                param.unsharded_storage.regrow()
        return buffers.allocate(bucket.total_numel, dtype, device, f"all-gather output of {self.labels[index]}")

    def _make_unsharded(self, param: ShardedParam, data: torch.Tensor) -> None:
        param.unsharded = nn.Parameter(data, requires_grad=param.requires_grad)
        if param.requires_grad:
            # The hook lives in C++ on the tensor, out of reach of Python's cycle
            # collector: a strong reference back to the group would keep the
            # whole model alive forever once it is dropped.
            group_ref, index = weakref.ref(self), self.params.index(param)

            def on_grad_accumulated(_unsharded: nn.Parameter) -> None:
                group = group_ref()
                if group is not None:
                    group._on_grad_accumulated(index)

            self._hooks.append(param.unsharded.register_post_accumulate_grad_hook(on_grad_accumulated))

    @torch.inference_mode(False)
    def wait_for_unshard(self) -> None:
        if self.state is GroupState.UNSHARDING:
            pending, self._pending_gathers = self._pending_gathers, []
            for gather in pending:
                gather.finish()
            self.state = GroupState.UNSHARDED

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
        group_size = dist.get_world_size(self.post_forward_group)
        span = self.world // group_size
        first = (dist.get_rank(self.process_group) % group_size) * span
        ranks = range(first, first + span)
        with torch.no_grad():
            for index, bucket in enumerate(self.buckets):
                members = [self.params[i] for i in bucket.members]
                kept = buffers.allocate(
                    span * bucket.chunk_numel, members[0].compute_dtype, members[0].device,
                    f"post-forward chunks of {self.labels[index]}",
                )
                pack_rank_chunks(kept.writable("keep chunks after forward"), bucket, members,
                                 [p.unsharded.detach() for p in members], ranks)
                self._kept.append(kept)
        self.reshard()

    def reshard(self) -> None:
        """Free the unsharded storage (owned by fullshard; autograd's references stay valid objects)."""
        self.wait_for_unshard()
        if self.state is GroupState.SHARDED:
            return
        for output in self._view_outputs:
            if output is not None:
                output.reclaim()
        for param in self.params:
            if param.unsharded_storage is not None:
                param.unsharded_storage.reclaim()
        self.state = GroupState.SHARDED

    def _shards_changed(self) -> bool:
        """Whether a shard was written since it was gathered (optimizer step, load_state_dict, ...).

        Autograd's version counter of the local shard says so exactly, whatever
        wrote it; the kept unsharded copy is then gathered again.
        """
        return any(p.shard_version() != p.gathered_version for p in self.params)

    def mark_stale(self) -> None:
        """Keep the unsharded storage but gather into it again before the next use (ZeRO-1/2)."""
        self.wait_for_unshard()
        self.state = GroupState.SHARDED

    @property
    def offloaded_to_host(self) -> bool:
        """Shards live in CPU memory while computing on an accelerator (copies may be in flight)."""
        return any(p.offloaded and p.device.type != "cpu" for p in self.params)

    def register_unsharded(self) -> None:
        for param in self.params:
            param.register_unsharded()

    def register_sharded(self) -> None:
        for param in self.params:
            param.register_sharded()

    def refresh_sharded(self) -> None:
        """Follow parameters the user replaced; re-plan and drop unsharded copies if any changed."""
        changed = [param.refresh_from_module() for param in self.params]
        if not any(changed):
            return
        self.reshard()
        for param in self.params:
            param.unsharded = param.unsharded_storage = None  # rebuilt (new dtype/device) at next unshard
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        self._plan()

    # ------------------------------------------------------------------ backward
    def _on_grad_accumulated(self, index: int) -> None:
        self._grads_ready.add(index)
        param = self.params[index]
        if checks.check_finite_enabled():
            checks.inspect(param.fqn, param.unsharded.grad)
        if not self.reduce_grads and param.compute_dtype != self.reduce_dtype(param):
            # Accumulating without sync: sum in the reduce dtype (e.g. fp32 for bf16 compute).
            param.accumulate_grad_in(self.reduce_dtype(param), f"gradient accumulator of '{param.fqn}'")
        if self.on_grad_ready is not None:
            self.on_grad_ready(self)

    on_grad_ready = None  # set by the module state: called after each accumulated gradient

    @property
    def all_grads_ready(self) -> bool:
        return len(self._grads_ready) == len(self.trainable)

    @property
    def reduce_grads(self) -> bool:
        return self._reduce_grads

    @reduce_grads.setter
    def reduce_grads(self, value: bool) -> None:
        self._reduce_grads = value
        if not value:
            self.accumulated_without_sync = True

    @property
    def has_unfinished_grads(self) -> bool:
        """Some gradients arrived this backward but not all (unused parameters)."""
        return bool(self._grads_ready) and not self.backward_done

    def reduce(self) -> list[PendingReduce]:
        """Start reduce-scatters of the accumulated unsharded gradients; skip buckets with none."""
        pending = []
        divide = self.divide_factor if self.divide_factor is not None else self.world * self.replicas
        layouts = tuple(p.layout for p in self.params)
        for index, bucket in enumerate(self.buckets):
            members = [self.params[i] for i in bucket.members]
            if not members[0].requires_grad:
                continue
            grads = [p.take_unsharded_grad() for p in members]
            if self.reduce_unused_params:
                # Every rank reduces every bucket, a zero standing in for a gradient this rank lacks.
                grads = [g if g is not None else torch.zeros(p.layout.shape, dtype=p.compute_dtype, device=p.device)
                         for p, g in zip(members, grads)]
            if all(g is None for g in grads):
                continue
            present = [g for g in grads if g is not None]
            reduce_dtype = self.reduce_dtype(members[0])
            wire = self.gradient_wire_dtype(members[0].compute_dtype, reduce_dtype)
            plan = plan_reduce(
                bucket,
                layouts,
                grad_dtype_is_wire_dtype=all(g.dtype == wire for g in present),
                grads_contiguous=all(g.is_contiguous() for g in present),
                reduce_dtype_is_param_dtype=reduce_dtype == members[0].stored_dtype,
                all_reduce=self.all_reduce,
                offloaded=members[0].offloaded,
            )
            reduction = reduce_bucket(
                bucket, plan, members, grads, reduce_dtype, wire, self.process_group, divide, self.labels[index],
                self.exchange, self.reduce_tags[index], all_reduce=self.all_reduce,
            )
            reduction.hook = self.all_reduce_hook
            if self.replicate_group is not None:
                reduction.combine = functools.partial(self._sum_across_replicas, index)
            pending.append(reduction)
        self.accumulated_without_sync = False
        return pending

    def gradient_wire_dtype(self, compute_dtype: torch.dtype, reduce_dtype: torch.dtype) -> torch.dtype:
        """The dtype a bucket's gradients travel in (``plan.exchange.wire_dtype``), the same on every rank.

        Decided from what every rank shares (dtypes, the exchange, whether sync
        was off), never from the gradients this rank happens to hold: both ends
        of each message must agree on its size. A gradient in another dtype is
        cast into an owned input. All-reduce and accumulators: the reduce dtype.
        """
        if self.all_reduce or self.accumulated_without_sync:
            return reduce_dtype
        return getattr(torch, wire_dtype(self.exchange, _dtype_name(compute_dtype), _dtype_name(reduce_dtype)))

    def _sum_across_replicas(self, index: int, output: Owned) -> bool:
        """HSDP: add any partial sum, then all-reduce across replicas or keep it for later."""
        partial = self._partials.pop(index, None)
        if partial is not None:
            with torch.no_grad():
                output.writable("add the partial gradient sum").add_(partial.tensor)
            partial.reclaim()
        if not self.all_reduce_grads:
            self._partials[index] = output
            return False
        all_reduce_in_place(output, self.replicate_group)
        return True

    def reset_backward(self) -> None:
        self._grads_ready.clear()
        self.backward_done = False
        self.ran_forward = False
        self.shown_for_backward = False

    def abandon_step(self) -> None:
        """Forget this step's gradients (it raised): unreduced and reduced ones, HSDP partial sums,
        chunks kept after forward. As in FSDP2, an accumulation in progress is lost with them."""
        for param in self.params:
            if param.unsharded is not None:
                param.unsharded.grad = None
            if param.grad_accumulator is not None:
                param.grad_accumulator.reclaim()
                param.grad_accumulator = None
            param.sharded.grad = None
        for partial in self._partials.values():
            partial.reclaim()
        self._partials.clear()
        buffers.release_all(self._kept)
        self.accumulated_without_sync = not self.reduce_grads
