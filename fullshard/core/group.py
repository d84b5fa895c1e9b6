"""One group of parameters (one ``fully_shard`` call's) in a step, written once for every runtime: its gather
state and the rules that move it.

A runtime subclasses :class:`Group` with its framework's storage and collectives: the methods that raise
``NotImplementedError`` here (and the few with a default). The states and the events that move them
(:data:`GATHER_TRANSITIONS`, drawn in ``docs/design.md``)::

    SHARDED --unshard--> UNSHARDING --wait--> UNSHARDED --reshard--> SHARDED
    UNSHARDED --mark stale--> STALE --unshard (into the kept storage)--> UNSHARDING
    UNSHARDED --keep for the next forward--> KEPT --a forward uses it--> UNSHARDED

Every state a group can be in is one of these; nothing beside them says more (the settings below change
what the rules decide, not where a group is).
"""
from __future__ import annotations

import enum

from fullshard.plan.group import AfterBackward


class GatherState(enum.Enum):
    SHARDED = "sharded"  # the modules show the shards; no unsharded storage
    STALE = "stale"  # the modules show the shards; the unsharded storage stays for the next gather into it
    UNSHARDING = "unsharding"  # gathers issued, not yet waited on
    UNSHARDED = "unsharded"  # gathered: the modules show the unsharded parameters
    KEPT = "kept"  # gathered and kept for the next forward, which uses it as it is

    def __str__(self) -> str:
        return self.value


_GATHERED = (GatherState.UNSHARDED, GatherState.KEPT)

# (from, event, to): every move of a group's state this module makes (tests/core/test_lifecycle.py records each move
# of every scenario against it); docs/design.md draws it, and a test keeps the drawing equal to it.
GATHER_TRANSITIONS = (
    (GatherState.SHARDED, "unshard (issue the gathers)", GatherState.UNSHARDING),
    (GatherState.STALE, "unshard (into the kept storage)", GatherState.UNSHARDING),
    (GatherState.UNSHARDING, "wait", GatherState.UNSHARDED),
    (GatherState.UNSHARDED, "keep for the next forward", GatherState.KEPT),
    (GatherState.KEPT, "a forward uses it", GatherState.UNSHARDED),
    (GatherState.UNSHARDED, "reshard (free)", GatherState.SHARDED),
    (GatherState.KEPT, "reshard (free)", GatherState.SHARDED),
    (GatherState.STALE, "reshard (free)", GatherState.SHARDED),
    (GatherState.UNSHARDED, "mark stale (keep the storage)", GatherState.STALE),
    (GatherState.KEPT, "mark stale (keep the storage)", GatherState.STALE),
    *((state, "abandon the step", GatherState.SHARDED) for state in GatherState if state is not GatherState.SHARDED),
)


class Group:
    """One group of parameters (a ``fully_shard`` call's): where its gather stands, what a kept copy is worth,
    and the gradient settings the lifecycle reads. A runtime's group subclasses it with its framework's
    storage and collectives."""

    def __init__(self, after_backward: AfterBackward) -> None:
        self.state = GatherState.SHARDED
        self.after_backward = after_backward
        # FSDPModule.set_unshard_in_backward(False): no backward op reads these parameters.
        self.unshard_in_backward = True
        self.reduce_grads = True  # set_requires_gradient_sync
        self.all_reduce_grads = True  # set_requires_all_reduce (HSDP)
        self.reduce_unused_params = False  # set_reduce_scatter_unused_params
        # set_keep_unsharded_storage: a reshard keeps the storage (STALE), so gathers reuse its addresses.
        self.keep_unsharded_storage = False

    # ------------------------------------------------------------------ framework operations
    def _start_gather(self) -> None:
        """Issue every bucket's all-gather (a runtime may complete it at once), into the kept storage if any."""
        raise NotImplementedError

    def _finish_gather(self) -> None:
        """Wait for the gathers; the modules show the unsharded parameters."""
        raise NotImplementedError

    def _free(self, keep_post_forward_chunks: bool) -> None:
        """Reclaim the unsharded storage, gathered or kept (keeping this rank's chunks for a smaller backward
        gather, when asked and configured); the modules show the shards."""
        raise NotImplementedError

    def _keep(self) -> None:
        """The modules show the shards; the unsharded storage stays for the next gather into it."""
        raise NotImplementedError

    def rename(self, module_fqn: str) -> None:
        """Name the parameters by their paths from the root (known once the root adopts the unit)."""
        raise NotImplementedError

    def _keep_for_backward(self) -> None:
        """After a forward whose backward will come, without resharding: what the modules show meanwhile."""

    def _shards_changed(self) -> bool:
        """Whether a shard may have been written (an optimizer step, a load) since it was last gathered."""
        raise NotImplementedError

    def _drop_post_forward_chunks(self) -> None:
        """Forget the chunks a partial reshard kept for a backward that never came."""

    def _abandon_gathers(self) -> None:
        """A step raised: let gathers in flight end; storage a failed transfer may still write is dropped."""
        raise NotImplementedError

    def before_backward(self) -> None:
        """A backward is about to give this group's parameters gradients (a runtime may choose their dtype)."""

    def after_backward_pass(self) -> None:
        """This unit's backward for one forward is done (its reduction started, if it reduces)."""

    def has_pending_grads(self) -> bool:
        """Gradients arrived or accumulate since the last reduction."""
        raise NotImplementedError

    def _start_reduce(self) -> list:
        """Start reducing the pending gradients; objects whose ``finish()`` completes each reduction."""
        raise NotImplementedError

    def _abandon_grads(self) -> None:
        """Forget this step's gradients: unreduced, reduced, kept as partial sums."""
        raise NotImplementedError

    def refresh(self) -> None:
        """At a root forward: follow parameters the user replaced (a runtime that allows it)."""

    # ------------------------------------------------------------------ rules
    @property
    def shows_unsharded(self) -> bool:
        """The modules show the unsharded parameters (or will, once the gathers in flight are waited on)."""
        return self.state in (*_GATHERED, GatherState.UNSHARDING)

    def unshard(self) -> None:
        """Start gathering, unless the modules show a copy that is still right."""
        if self.state in _GATHERED and self._shards_changed():
            self.mark_stale()
        if self.state in (GatherState.SHARDED, GatherState.STALE):
            self._start_gather()
            self.state = GatherState.UNSHARDING

    def wait(self) -> None:
        if self.state is GatherState.UNSHARDING:
            self._finish_gather()
            self.state = GatherState.UNSHARDED

    def unshard_now(self) -> None:
        self.unshard()
        self.wait()

    def keep_for_next_forward(self) -> None:
        """The next forward uses the gathered parameters as they are (FSDP2's ``unshard()``, and a backward
        under ``set_reshard_after_backward(False)``), even across a step, while the shards do not change."""
        self.wait()
        if self.state is GatherState.UNSHARDED:
            self.state = GatherState.KEPT

    def use_in_forward(self) -> None:
        """A forward begins with these parameters: a copy kept for it is used up."""
        if self.state is GatherState.KEPT:
            self.state = GatherState.UNSHARDED

    def reshard(self, after_forward: bool = False) -> None:
        """Free the unsharded storage, kept storage included, and show the shards (``after_forward``: a policy
        may keep this rank's chunks for the backward gather)."""
        self.wait()
        if self.state is GatherState.SHARDED:
            return
        if self.keep_unsharded_storage:
            self.mark_stale()
            return
        self._free(after_forward and self.state is GatherState.UNSHARDED)
        self.state = GatherState.SHARDED

    def mark_stale(self) -> None:
        """Show the shards but keep the storage; gather into it again before the next use (ZeRO-1/2)."""
        self.wait()
        if self.state in _GATHERED:
            self._keep()
            self.state = GatherState.STALE

    def begin_step(self, keep: bool) -> None:
        """A new root forward: a copy gathered before is kept only while no optimizer step can have come since
        (``keep``: gradients accumulate without sync, or a forward's backward is still to come), or when it was
        gathered or kept for this forward (an explicit unshard(), reshard_after_backward=False); every other
        step gathers afresh."""
        if keep or self.state in (GatherState.KEPT, GatherState.UNSHARDING):
            return
        self.mark_stale()
        self._drop_post_forward_chunks()

    def after_reducing_backward(self) -> None:
        """The end of a backward: reshard, keep gathered for the next forward, or keep the storage (the
        optimizer steps next: ZeRO-1/2)."""
        if self.after_backward is AfterBackward.RESHARD:
            self.reshard()
        elif self.after_backward is AfterBackward.KEEP_GATHERED:
            self.keep_for_next_forward()  # whatever the next forward's setting
        elif self.reduce_grads:
            # reduced: the optimizer will change the shards, and the sharded gradients are what it reads
            self.mark_stale()

    def abandon(self) -> None:
        """The step raised: gathers in flight end, the shards are shown again, this step's gradients go."""
        self._abandon_grads()
        self._abandon_gathers()
        self.state = GatherState.SHARDED
