"""What only the root of a model knows: its units, the end of backward, and that the ranks agree.

The first sharded cell whose forward runs while no other is running is the
root of that forward; at its first forward it gathers every unit below it
into one :class:`RootContext`, which every unit then points to.
"""
from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

from fullshard.core.agreement import check_ranks_agree
from fullshard.mindspore.autograd import queue_after_backward
from fullshard.mindspore.exchange import sum_floats

if TYPE_CHECKING:
    from fullshard.mindspore.state import ShardState


class RootContext:
    def __init__(self, root: "ShardState") -> None:
        self.root = root
        self.states: list[ShardState] = [root]  # every unit under the root, in cell order
        self.final_callback_queued = False

    @property
    def groups(self) -> list:
        return [g for s in self.states for g in s.groups]

    def adopt(self, name: str, state: "ShardState") -> None:
        self.states.append(state)
        state.context, state.is_root = self, False
        for group in state.groups:
            group.plan.rename(name)  # errors and labels name parameters from the root

    # ------------------------------------------------------------------ forward
    def begin_step(self) -> None:
        """The root's forward starts a step: forget unsharded copies an earlier step left, unless right."""
        for state in self.states:
            for group in state.groups:
                # Copies stay only while no optimizer step can have come since their gather: gradients
                # accumulating without sync, or forwards whose backward is still to come.
                group.unsharder.begin_step(keep=group.reducer.has_pending_grads() or state.forwards_with_grad > 0)

    def finish_forward(self) -> None:
        for state in self.states:
            state.finish_partial_forward()

    # ------------------------------------------------------------------ backward
    def queue_final_callback(self) -> None:
        if not self.final_callback_queued:
            self.final_callback_queued = True
            queue_after_backward(self.end_of_backward)

    def end_of_backward(self) -> None:
        """MindSpore's last callback of the backward pass: every bucket has reduced (or never will)."""
        self.final_callback_queued = False
        for state in self.states:
            state.end_backward()

    def reset_step(self) -> None:
        """Abandon the step in flight (it raised): kept gradients dropped, every unit resharded."""
        self.final_callback_queued = False
        for state in self.states:
            state.reset_step()

    # ------------------------------------------------------------------ agreement
    def check_ranks_agree(self) -> None:
        """Fail at the first step, not later with mismatched collectives, if ranks wrapped different models:
        the shard group and the replicas compare a fixed-size fingerprint (``fullshard.core.agreement``)."""
        groups = self.groups
        if not groups:
            return
        rows = [
            (p.fqn, p.layout.shape, p.layout.dim, str(p.stored_dtype), str(p.compute_dtype), p.requires_grad,
             g.replicated)
            for g in groups for p in g.params
        ]
        comms = [("shard", groups[0].comm), ("replicate", groups[0].reducer.replica)]
        check_ranks_agree(
            rows, [(name, comm.size, partial(sum_floats, comm=comm)) for name, comm in comms if comm is not None],
            "every rank must build the same model and apply fully_shard the same way",
        )
