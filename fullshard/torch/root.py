"""What only the root of a model knows: its units in order, the reductions in flight, the end of backward.

The first sharded module whose forward runs while no other is running is the
root of that forward; at its first forward it gathers every unit below it
into one :class:`RootContext`, which every unit then points to. Nothing here
is kept per unit.
"""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist
from torch.autograd import Variable
from torch.profiler import record_function

from fullshard.core.agreement import check_ranks_agree
from fullshard.core.phases import TrainingPhase
from fullshard.plan.strategy import AfterBackward
from fullshard.torch import checks
from fullshard.torch.collectives import PendingReduce
from fullshard.torch.errors import NotMaterializedError

if TYPE_CHECKING:
    from fullshard.torch.state import ShardState


class RootContext:
    def __init__(self, root: "ShardState") -> None:
        self.root = root
        self.states: list[ShardState] = [root]  # every unit under the root, in module order
        # Units in the order their forward began, and in the order it ended.
        # Backward runs in the reverse of the second: the root's head, whose
        # forward ends last, first; then the last block, and so on.
        self.forward_order: list[ShardState] = []
        self.post_forward_order: list[ShardState] = []
        self.order_recorded = False
        self.pending_reduces: list[PendingReduce] = []
        self.final_callback_queued = False
        self.forward_thread: Optional[int] = None
        self.post_optim_event: Any = None  # FSDPModule.set_post_optim_event

    @property
    def groups(self) -> list:
        return [s.group for s in self.states if s.group is not None]

    def adopt(self, name: str, state: "ShardState") -> None:
        self.states.append(state)
        state.context, state.is_root = self, False
        if state.group is not None:
            state.group.plan.rename(name)  # errors and labels name parameters from the root

    # ------------------------------------------------------------------ forward
    def begin_step(self) -> None:
        """The root's forward starts a step: re-adopt replaced parameters, forget stale copies."""
        self.forward_thread = threading.get_ident()
        for state in self.states:
            group = state.group
            if group is None:
                continue
            group.refresh_sharded()  # cheap identity checks
            self.check_materialized(group)
            # Copies stay only while no optimizer step can have come since their gather: gradients
            # accumulating without sync, or forwards whose backward is still to come.
            group.unsharder.begin_step(keep=group.reducer.has_pending_grads() or state.forwards_with_grad > 0)
        if self.post_optim_event is not None:
            self.post_optim_event.wait()  # the gathers that follow run on the current stream
            self.post_optim_event = None

    def record_forward(self, state: "ShardState", ended: bool) -> None:
        order = self.post_forward_order if ended else self.forward_order
        if not self.order_recorded and state not in order:
            order.append(state)

    def neighbour(self, state: "ShardState", offset: int) -> list["ShardState"]:
        """The unit that runs next in forward (+1) or in backward (-1), from the order recorded in forward."""
        order = self.forward_order if offset > 0 else self.post_forward_order
        if not self.order_recorded or state not in order:
            return []
        index = order.index(state) + offset
        return [order[index]] if 0 <= index < len(order) else []

    def finish_forward(self) -> None:
        self.order_recorded = True
        # Groups of several modules where not all ran still follow their policy.
        for state in self.states:
            state.finish_partial_forward()

    # ------------------------------------------------------------------ backward
    def queue_final_callback(self) -> None:
        if not self.final_callback_queued:
            self.final_callback_queued = True
            Variable._execution_engine.queue_callback(self.end_of_backward)

    def start_reduce(self, state: "ShardState") -> None:
        """Reduce a unit's pending gradients, keeping at most one unit's reductions in flight:
        finishing the previous ones here bounds memory and overlaps them with this backward."""
        self.finish_reduces()
        with record_function(state.label("reduce-scatter")):
            self.pending_reduces.extend(state.group.reducer.reduce())

    def finish_reduces(self) -> None:
        pending, self.pending_reduces = self.pending_reduces, []
        for reduce in pending:
            reduce.finish()

    def end_of_backward(self) -> None:
        """Autograd's last callback: reduce what no unit's post-backward did, wait, reshard."""
        with record_function("fullshard::root end of backward"):
            for state in self.states:
                state.reduce_leftovers()
            # ZeRO-1 reduces every group once, here, in the same order on every rank.
            for state in reversed(self.states):
                if state.group is not None and state.group.reducer.reduce_grads and state.reduces_at_end_of_backward:
                    self.start_reduce(state)
            self.complete_backward()

    def complete_backward(self) -> None:
        """Wait for the reductions in flight, then reshard and show the shards."""
        self.finish_reduces()
        offloaded = [g for g in self.groups if g.offloaded_to_host]
        if offloaded:
            # gradients copied to pinned host memory without blocking: done before the optimizer reads them
            getattr(torch, offloaded[0].params[0].device.type).synchronize()
        for state in self.states:
            group = state.group
            state.phase = TrainingPhase.IDLE
            state.forwards_with_grad = 0
            if group is None:
                continue
            with record_function(state.label("reshard")):
                if group.after_backward is AfterBackward.RESHARD:
                    group.unsharder.reshard()
                elif group.after_backward is AfterBackward.KEEP_GATHERED:
                    group.unsharder.keep_for_next_forward = True  # whatever the next forward's setting
                elif group.reducer.reduce_grads:
                    # reduced: the optimizer will change the shards, and the sharded gradients are
                    # what it reads: show the shards; the storage stays for the next gather (ZeRO-1/2)
                    group.unsharder.mark_stale()
        self.final_callback_queued = False
        if checks.check_finite_enabled() and self.groups:
            checks.raise_if_any(self.groups[0].process_group)

    # ------------------------------------------------------------------ failures
    def reset_step(self) -> None:
        """Abandon the step in flight (it raised): pending reductions and unreduced gradients are
        dropped, every unit is resharded and shows its sharded parameters."""
        self.final_callback_queued = False
        for reduce in self.pending_reduces:
            reduce.abandon()
        self.pending_reduces.clear()
        for state in self.states:
            state.phase = TrainingPhase.IDLE
            state.forwards_with_grad = 0
            if state.group is not None:
                state.group.reducer.abandon_step()
                state.group.unsharder.abandon()

    # ------------------------------------------------------------------ agreement
    def check_materialized(self, group) -> None:
        """Parameters still on the meta device would be trained as garbage: name them (FSDP2's words).
        Checked after re-adopting replaced parameters (``load_state_dict(assign=True)`` materializes)."""
        meta = [p.fqn for p in group.params if p.sharded.device.type == "meta"]
        if meta:
            raise NotMaterializedError(
                "FSDP parameters should be materialized from meta device before training, but the following "
                f"were still on meta device: {meta}; call model.to_empty(device=...) and initialize them "
                "(e.g. fullshard.torch.materialize.materialize(model)) before the first forward"
            )

    def check_ranks_agree(self) -> None:
        """Fail at the first step, not hang later, if ranks wrapped different models: every group of the mesh
        (shard, replicas, tensor parallel) compares a fixed-size fingerprint (``fullshard.core.agreement``)."""
        groups = self.groups
        if not groups:
            return
        rows = [
            (p.fqn, tuple(p.spec.shape), p.layout.dim, str(p.stored_dtype), str(p.compute_dtype), p.requires_grad,
             repr(p.placements))
            for group in groups for p in group.params
        ]
        # Ranks that move bytes differently (FULLSHARD_EXCHANGE set on some only) would wait on each other forever.
        rows += [(f"exchange of module '{group.module_name}'", group.plan.exchange.value) for group in groups]
        sample = groups[0].params[0]
        mesh, device = sample.mesh, sample.device
        names = mesh.mesh_dim_names or tuple(f"mesh dim {d}" for d in range(mesh.ndim))

        def summing(process_group):
            def sum_over_group(values: list[float]) -> list[float]:
                buffer = torch.tensor(values, dtype=torch.float32, device=device)
                dist.all_reduce(buffer, group=process_group)
                return buffer.tolist()
            return sum_over_group

        check_ranks_agree(
            rows,
            [(names[d], mesh.size(d), summing(mesh.get_group(d))) for d in range(mesh.ndim)],
            "every rank must build the same model, apply fully_shard the same way and set FULLSHARD_EXCHANGE alike "
            "(or nowhere)",
        )
