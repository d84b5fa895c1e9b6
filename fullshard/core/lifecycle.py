"""The life of a sharded unit in a training step, written once for every runtime.

A *unit* is what one ``fully_shard`` call leaves on a module (torch) or cell
(MindSpore): the groups of parameters it gathers and reduces, and its place in
a root's step. The runtime's hooks call the transitions below when its
framework reaches them; every rule about what happens then (gather or not,
keep or reshard, reduce now or at the end of backward, prefetch whom, what a
kept copy is worth, how a failed step is abandoned) lives here. A runtime
subclasses :class:`Group`, :class:`Unit` and :class:`Root` and supplies only
its framework's operations: the methods whose names start with ``_`` and
raise ``NotImplementedError`` here.

Phases of a unit (:class:`TrainingPhase`) and the events that move it
(:data:`TRANSITIONS`, drawn in ``docs/design.md``)::

    IDLE --pre-forward--> PRE_FORWARD --gathered--> FORWARD --post-forward--> IDLE
    IDLE --pre-backward--> PRE_BACKWARD --post-backward--> POST_BACKWARD --end of backward--> IDLE

and of a group's parameters (:class:`GatherState`, :data:`GATHER_TRANSITIONS`)::

    SHARDED --unshard--> UNSHARDING --wait--> UNSHARDED --reshard (free) | mark stale (keep storage)--> SHARDED

A unit used twice in one forward goes through PRE_BACKWARD / POST_BACKWARD
once per use; the root's end of backward returns every unit to IDLE, and
abandoning a step (it raised) does too, from any phase.
"""
from __future__ import annotations

import contextlib
import enum
import threading
from typing import Any, Iterable, Iterator, Optional

from fullshard.plan.strategy import AfterBackward, Lifecycle, lifecycle

STATE_ATTR = "_fullshard_state"  # where a module or cell keeps its unit


class TrainingPhase(enum.Enum):
    IDLE = "idle"
    PRE_FORWARD = "pre-forward"
    FORWARD = "forward"
    PRE_BACKWARD = "pre-backward"
    POST_BACKWARD = "post-backward"

    def __str__(self) -> str:
        return self.value


class GatherState(enum.Enum):
    SHARDED = "sharded"
    UNSHARDING = "unsharding"  # gathers issued, not yet waited on
    UNSHARDED = "unsharded"


# (from, event, to): every move of a unit's phase this module makes (tests/test_lifecycle.py records each move
# of every scenario against it); docs/design.md draws it, and a test keeps the drawing equal to it.
TRANSITIONS = (
    (TrainingPhase.IDLE, "pre-forward (gather)", TrainingPhase.PRE_FORWARD),
    (TrainingPhase.PRE_FORWARD, "gathered", TrainingPhase.FORWARD),
    (TrainingPhase.FORWARD, "post-forward (keep or reshard)", TrainingPhase.IDLE),
    (TrainingPhase.IDLE, "pre-backward (gather again)", TrainingPhase.PRE_BACKWARD),
    (TrainingPhase.PRE_BACKWARD, "post-backward (reduce, reshard)", TrainingPhase.POST_BACKWARD),
    (TrainingPhase.POST_BACKWARD, "pre-backward (another use)", TrainingPhase.PRE_BACKWARD),
    (TrainingPhase.IDLE, "gradients reduced outside a backward pass", TrainingPhase.POST_BACKWARD),
    (TrainingPhase.POST_BACKWARD, "end of backward", TrainingPhase.IDLE),
    (TrainingPhase.PRE_BACKWARD, "end of backward", TrainingPhase.IDLE),
    *((phase, "abandon the step", TrainingPhase.IDLE) for phase in TrainingPhase if phase is not TrainingPhase.IDLE),
)

# The same for a group's parameters (GatherState).
GATHER_TRANSITIONS = (
    (GatherState.SHARDED, "unshard (issue the gathers)", GatherState.UNSHARDING),
    (GatherState.UNSHARDING, "wait", GatherState.UNSHARDED),
    (GatherState.UNSHARDED, "reshard (free) or mark stale (keep the storage)", GatherState.SHARDED),
    (GatherState.UNSHARDING, "abandon the step", GatherState.SHARDED),
)


class Group:
    """One group of parameters (a ``fully_shard`` call's): whether they are gathered, what a kept copy is worth,
    and the gradient settings the lifecycle reads. A runtime's group subclasses it with its framework's
    storage and collectives."""

    def __init__(self, after_backward: AfterBackward) -> None:
        self.state = GatherState.SHARDED
        self.after_backward = after_backward
        # FSDPModule.set_unshard_in_backward(False): no backward op reads these parameters.
        self.unshard_in_backward = True
        # The next forward uses the gather as it is: an explicit unshard() (FSDP2's meaning), or a backward
        # that kept the parameters gathered (set_reshard_after_backward(False)).
        self.keep_for_next_forward = False
        # An explicit unshard() that holds until reshard() (the seed library's meaning, on MindSpore).
        self.held = False
        # Sharded, but the unsharded storage stays allocated for the next gather into it (mark_stale).
        self.storage_kept = False
        self.reduce_grads = True  # set_requires_gradient_sync
        self.all_reduce_grads = True  # set_requires_all_reduce (HSDP)
        self.reduce_unused_params = False  # set_reduce_scatter_unused_params

    # ------------------------------------------------------------------ framework operations
    def _start_gather(self) -> None:
        """Issue every bucket's all-gather (a runtime may complete it at once)."""
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
        """Whether a shard was written (an optimizer step, a load) since it was last gathered."""
        raise NotImplementedError

    def _drop_post_forward_chunks(self) -> None:
        """Forget the chunks a partial reshard kept for a backward that never came."""

    def _abandon_gathers(self) -> None:
        """A step raised: let gathers in flight end; storage a failed transfer may still write is dropped."""
        raise NotImplementedError

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
    def unshard(self) -> None:
        """Start gathering, unless the modules show a copy that is still right."""
        if self.state is GatherState.UNSHARDED and self._shards_changed():
            self.mark_stale()
        if self.state is GatherState.SHARDED:
            self._start_gather()
            self.state, self.storage_kept = GatherState.UNSHARDING, False

    def wait(self) -> None:
        if self.state is GatherState.UNSHARDING:
            self._finish_gather()
            self.state = GatherState.UNSHARDED

    def unshard_now(self) -> None:
        self.unshard()
        self.wait()

    def reshard(self, after_forward: bool = False) -> None:
        """Free the unsharded storage, kept storage included, and show the shards (``after_forward``: a policy
        may keep this rank's chunks for the backward gather)."""
        self.wait()
        self.keep_for_next_forward = self.held = False
        if self.state is GatherState.SHARDED and not self.storage_kept:
            return
        self._free(after_forward and self.state is GatherState.UNSHARDED)
        self.state, self.storage_kept = GatherState.SHARDED, False

    def mark_stale(self) -> None:
        """Show the shards but keep the storage; gather into it again before the next use (ZeRO-1/2)."""
        self.wait()
        self.keep_for_next_forward = self.held = False
        if self.state is GatherState.UNSHARDED:
            self._keep()
            self.state, self.storage_kept = GatherState.SHARDED, True

    def begin_step(self, keep: bool) -> None:
        """A new root forward: a copy gathered before is kept only while no optimizer step can have come since
        (``keep``: gradients accumulate without sync, or a forward's backward is still to come), or when the
        user asked for it; every other step gathers afresh."""
        if self.keep_for_next_forward or self.held or keep:
            return
        if self.state is not GatherState.SHARDED:
            self.mark_stale()
        self._drop_post_forward_chunks()

    def after_reducing_backward(self) -> None:
        """The end of a backward: reshard, keep gathered for the next forward, or keep the storage (the
        optimizer steps next: ZeRO-1/2)."""
        if self.after_backward is AfterBackward.RESHARD:
            self.reshard()
        elif self.after_backward is AfterBackward.KEEP_GATHERED:
            self.keep_for_next_forward = True  # whatever the next forward's setting
        elif self.reduce_grads:
            # reduced: the optimizer will change the shards, and the sharded gradients are what it reads
            self.mark_stale()

    def abandon(self) -> None:
        """The step raised: gathers in flight end, the shards are shown again, this step's gradients go."""
        self._abandon_grads()
        self._abandon_gathers()
        self.keep_for_next_forward = self.held = self.storage_kept = False
        self.state = GatherState.SHARDED


class Unit:
    """One ``fully_shard`` call's place in a step: its phase, its groups, how it finds its root. A runtime's
    unit subclasses it, sets :attr:`root_class` and :attr:`active`, provides :meth:`_named_submodules`,
    and calls the transitions from its framework's hooks."""

    root_class: type  # the runtime's Root
    active: Any  # a threading.local; ``.root``: the root unit whose forward runs in this thread
    # Without explicit targets, prefetch the neighbour in the order the root recorded in its first forward.
    implicit_forward_prefetch = True
    implicit_backward_prefetch = True

    def __init__(self, groups: list[Group], strategy: Any, reshard_after_forward: Optional[bool],
                 module_count: int) -> None:
        self.groups = groups
        self.strategy = strategy
        self._reshard_after_forward = reshard_after_forward
        self.module_count = module_count  # a unit of several modules ends its forward after the last one
        self.phase = TrainingPhase.IDLE
        self.is_root: Optional[bool] = None
        self.context: Optional[Root] = None  # the root's, once a root forward ran
        # Explicit prefetch targets (set_modules_to_*_prefetch); empty: the implicit neighbour.
        self.forward_prefetch: list[Unit] = []
        self.backward_prefetch: list[Unit] = []
        self._forward_done: set[int] = set()  # modules of this unit whose forward ran in this pass
        # Forwards since the last end of backward whose outputs need a gradient: their backward is to come.
        self.forwards_with_grad = 0

    # ------------------------------------------------------------------ what the runtime supplies
    def _named_submodules(self) -> Iterable[tuple[str, Any]]:
        """(path, module) of every module under this unit's, itself included."""
        raise NotImplementedError

    def _profile(self, label: str) -> Any:
        """A context naming the work inside it in the framework's profiler."""
        return contextlib.nullcontext()

    @property
    def name(self) -> str:
        raise NotImplementedError

    # ------------------------------------------------------------------ policy
    @property
    def lifecycle(self) -> Lifecycle:
        return lifecycle(self.strategy, bool(self.is_root), self._reshard_after_forward)

    @property
    def reshard_after_forward(self) -> bool:
        """The policy's choice, except for a unit whose gradients may reach only some ranks
        (``reduce_unused_params``): its backward may run on some ranks and not others, so it must not gather
        again there (a collective the others never join); it keeps its parameters until the end of backward."""
        return self.lifecycle.reshard_after_forward and not any(g.reduce_unused_params for g in self.groups)

    @reshard_after_forward.setter
    def reshard_after_forward(self, value: bool) -> None:
        self._reshard_after_forward = value

    def profiled(self, what: str) -> Any:
        """``fullshard::<phase> <what> (<unit>)`` in the profiler."""
        return self._profile(f"fullshard::{self.phase} {what} ({self.name})")

    # ------------------------------------------------------------------ finding the root
    def lazy_init_as_root(self) -> "Root":
        """The root's first forward adopts every unit below it, and the ranks check they agree."""
        if self.context is not None:
            return self.context
        context = self.root_class(self)
        self.context, self.is_root = context, True
        for name, sub in self._named_submodules():
            unit = getattr(sub, STATE_ATTR, None)
            if unit is not None and unit not in context.units:
                context.adopt(name, unit)  # also takes over a unit that ran alone before
        # Before the first gather: every unit's settings, also those of units that gather later in the step.
        context.check_agreement(context.units)
        return context

    def ensure_context(self) -> "Root":
        """A unit outside its root's modules (called from the root's forward) joins the active root, whose check
        did not describe it: the ranks compare its settings before its first gather."""
        if self.context is None:
            root = getattr(self.active, "root", None)
            if root is not None and root.context is not None:
                root.context.adopt("", self)
                root.context.check_agreement([self])
            else:
                self.lazy_init_as_root()
        return self.context

    def enter_root_forward(self) -> bool:
        """At a forward that no other root's forward encloses: this unit is the root of the step that begins.
        False when another root's forward runs (this unit is one of its units)."""
        if getattr(self.active, "root", None) is not None:
            return False
        self.lazy_init_as_root()
        self.active.root = self
        self.context.begin_step()
        return True

    def leave_root_forward(self) -> None:
        if getattr(self.active, "root", None) is self:
            if self.context is not None and self is self.context.root:
                self.context.finish_forward()
            self.active.root = None

    # ------------------------------------------------------------------ forward
    def pre_forward(self, prefetch: bool) -> None:
        """Gather (issuing the next unit's gathers first when ``prefetch``), then the forward computes."""
        if self.groups:
            context = self.ensure_context()  # may compare this unit across ranks first: it raises in IDLE
            self.phase = TrainingPhase.PRE_FORWARD
            context.record_forward(self, ended=False)
            with self.profiled("all-gather"):
                for group in self.groups:
                    group.unshard()
                if prefetch:  # issued before waiting for this unit's own: both transfers in flight at once
                    self.prefetch(self.forward_prefetch or self._neighbour(+1), backward=False)
                for group in self.groups:
                    group.wait()
        self.phase = TrainingPhase.FORWARD

    def post_forward(self, module: Any, needs_grad: bool, in_backward: bool) -> None:
        """One module of the unit ran its forward; ``needs_grad``: its outputs will get a gradient."""
        if not self.groups:
            return
        if needs_grad and not in_backward:
            self.forwards_with_grad += 1
        self._forward_done.add(id(module))
        if len(self._forward_done) < self.module_count:
            return
        self._forward_done.clear()
        if not in_backward:
            self.context.record_forward(self, ended=True)
            self.release_after_forward()
        for group in self.groups:
            group.keep_for_next_forward = False  # used up by this forward
        self.phase = TrainingPhase.IDLE

    def release_after_forward(self) -> None:
        """After forward, keep what backward needs, as the policy says. Without a forward whose outputs need a
        gradient since the last backward, no backward is to come: the modules show their shards again, so a
        write through the parameters lands in the shards and the next forward gathers it (into the storage
        kept, when the policy keeps it)."""
        with self.profiled("reshard"):
            for group in self.groups:
                if group.held:
                    continue
                if not self.forwards_with_grad:
                    group.reshard() if self.reshard_after_forward else group.mark_stale()
                elif self.reshard_after_forward:
                    group.reshard(after_forward=True)
                else:
                    group._keep_for_backward()

    def finish_partial_forward(self) -> None:
        """At the root's post-forward: a unit of several modules where not all ran, or one prefetched but not
        run, still follows its policy (an explicit unshard() is left for the next forward)."""
        if self._forward_done:
            self._forward_done.clear()
            self.phase = TrainingPhase.IDLE
        if not self.is_root and not any(g.keep_for_next_forward or g.held for g in self.groups):
            self.release_after_forward()

    def gather_for_recomputation(self) -> None:
        """Activation checkpointing recomputes this unit inside its own backward: it shows the unsharded
        parameters already (a nested use may have resharded them)."""
        for group in self.groups:
            if group.unshard_in_backward:
                with self.profiled("all-gather"):
                    group.unshard_now()

    # ------------------------------------------------------------------ backward
    def pre_backward(self) -> None:
        """Backward reached this unit's outputs: gather again, and prefetch the unit backward reaches next."""
        if self.phase is TrainingPhase.PRE_BACKWARD:
            return
        self.context.queue_end_of_backward()
        self.phase = TrainingPhase.PRE_BACKWARD
        with self.profiled("all-gather"):
            for group in self.groups:
                if group.unshard_in_backward:
                    group.unshard()
            self.prefetch(self.backward_prefetch or self._neighbour(-1), backward=True)
            for group in self.groups:
                if group.unshard_in_backward:
                    group.wait()

    def prefetch(self, units: list["Unit"], backward: bool) -> None:
        """Issue these units' gathers now, to overlap with this unit's compute."""
        for other in units:
            for group in other.groups:
                if group.unshard_in_backward or not backward:
                    with other.profiled("prefetch all-gather"):
                        group.unshard()

    def _neighbour(self, offset: int) -> list["Unit"]:
        implicit = self.implicit_forward_prefetch if offset > 0 else self.implicit_backward_prefetch
        return self.context.neighbour(self, offset) if implicit else []

    @property
    def reduces_at_end_of_backward(self) -> bool:
        return self.lifecycle.reduce_at_end_of_backward

    def post_backward(self) -> None:
        """This unit's backward for one forward is done: reduce its gradients, and reshard."""
        self.phase = TrainingPhase.POST_BACKWARD
        # With reduce_unused_params, which gradients arrive differs between ranks, so
        # those groups reduce at the end of backward instead, in module order on every rank.
        if any(g.reduce_grads and not g.reduce_unused_params and g.has_pending_grads() for g in self.groups) \
                and not self.reduces_at_end_of_backward:
            self.context.start_reduce(self)
        for group in self.groups:
            if group.after_backward is AfterBackward.RESHARD:
                with self.profiled("reshard"):
                    group.reshard()

    def reduce_leftovers(self) -> None:
        """At the end of backward: reduce gradients no post-backward reduced (inputs that need no gradient,
        gradients that came late), and every reduce_unused_params unit that ran forward."""
        if self.reduces_at_end_of_backward or not any(g.reduce_grads for g in self.groups):
            return
        if any(g.reduce_unused_params for g in self.groups):
            if self.forwards_with_grad:
                self.context.start_reduce(self)
        elif any(g.has_pending_grads() for g in self.groups):
            self.phase = TrainingPhase.POST_BACKWARD
            self.context.start_reduce(self)

    def reduce_accumulated_grads(self) -> None:
        """Reduce this unit's accumulated gradients now, outside autograd (torch.distributed.pipelining does
        this after its last micro-batch, then completes the backward on the stage's root)."""
        if any(g.reduce_grads for g in self.groups):
            self.phase = TrainingPhase.POST_BACKWARD
            (self.context or self.lazy_init_as_root()).start_reduce(self)

    def reset_step(self) -> None:
        """FSDPModule.reset_iter_state: abandon the step in flight (call on the root)."""
        (self.context or self.root_class(self)).reset_step()
        self.active.root = None


class Root:
    """What only the root of a model knows: its units in order, the reductions in flight, the end of backward.

    The first sharded module whose forward runs while no other is running is the root of that forward; at its
    first forward it adopts every unit below it, which then point to it. A runtime subclasses it with how to
    queue the end-of-backward callback and how ranks compare what they wrapped.
    """

    def __init__(self, root: Unit) -> None:
        self.root = root
        self.units: list[Unit] = [root]  # every unit under the root, in module order
        # Units in the order their forward began, and in the order it ended. Backward runs in the reverse of
        # the second: the root's head, whose forward ends last, first; then the last block, and so on.
        self.forward_order: list[Unit] = []
        self.post_forward_order: list[Unit] = []
        self.order_recorded = False
        self.pending_reduces: list = []
        self.end_of_backward_queued = False
        self.forward_thread: Optional[int] = None

    # ------------------------------------------------------------------ what the runtime supplies
    def _queue_end_of_backward(self) -> None:
        """Make the framework call :meth:`end_of_backward` once the backward in flight is done."""
        raise NotImplementedError

    def check_ranks_agree(self, units: list[Unit]) -> None:
        """Fail on every rank if ranks set up ``units`` differently (``fullshard.core.agreement``)."""
        raise NotImplementedError

    def _before_gathers(self) -> None:
        """At the start of a step, before its first gather."""

    def _after_reductions(self) -> None:
        """Every reduction of the backward is complete (e.g. wait for gradient copies still in flight)."""

    def _after_backward(self) -> None:
        """The backward is complete and every unit resharded (e.g. report what the optional checks found)."""

    # ------------------------------------------------------------------ units
    @property
    def groups(self) -> list:
        return [g for unit in self.units for g in unit.groups]

    def adopt(self, name: str, unit: Unit) -> None:
        self.units.append(unit)
        unit.context, unit.is_root = self, False
        for group in unit.groups:
            group.rename(name)  # errors and labels name parameters from the root

    def check_agreement(self, units: list[Unit]) -> None:
        """Compare ``units`` across ranks; if they differ, they leave this root (the next forward checks again)."""
        try:
            self.check_ranks_agree(units)
        except Exception:
            for unit in units:
                unit.context, unit.is_root = None, None
            self.units = [unit for unit in self.units if unit not in units]
            raise

    # ------------------------------------------------------------------ forward
    def begin_step(self) -> None:
        """The root's forward starts a step: follow replaced parameters, forget copies no longer right."""
        self.forward_thread = threading.get_ident()
        for unit in self.units:
            for group in unit.groups:
                group.refresh()
                group.begin_step(keep=group.has_pending_grads() or unit.forwards_with_grad > 0)
        self._before_gathers()

    def record_forward(self, unit: Unit, ended: bool) -> None:
        order = self.post_forward_order if ended else self.forward_order
        if not self.order_recorded and unit not in order:
            order.append(unit)

    def neighbour(self, unit: Unit, offset: int) -> list[Unit]:
        """The unit that runs next in forward (+1) or in backward (-1), from the order recorded in forward."""
        order = self.forward_order if offset > 0 else self.post_forward_order
        if not self.order_recorded or unit not in order:
            return []
        index = order.index(unit) + offset
        return [order[index]] if 0 <= index < len(order) else []

    def finish_forward(self) -> None:
        self.order_recorded = True
        for unit in self.units:
            unit.finish_partial_forward()

    def check_not_in_backward(self, what: str) -> None:
        """A forward from another thread while this model's backward runs would race on its buffers; the
        same thread forwarding again means that backward raised: start clean."""
        if not self.end_of_backward_queued:
            return
        if threading.get_ident() == self.forward_thread:
            self.reset_step()
            return
        raise RuntimeError(
            f"{what} (fully_shard) was called from another thread while its backward is running on the thread "
            "that ran its forward; run forward and backward of one model from one thread"
        )

    # ------------------------------------------------------------------ backward
    def queue_end_of_backward(self) -> None:
        if not self.end_of_backward_queued:
            self.end_of_backward_queued = True
            self._queue_end_of_backward()

    def start_reduce(self, unit: Unit) -> None:
        """A unit's gradients are ready: reduce them, keeping at most one unit's reductions in flight (finishing
        the previous ones here bounds memory and overlaps them with this backward)."""
        groups = [group for group in unit.groups if group.reduce_grads]
        if not groups:
            return
        self.finish_reduces()
        with unit.profiled("reduce-scatter"):
            self.pending_reduces.extend(reduction for group in groups for reduction in group._start_reduce())

    def finish_reduces(self) -> None:
        pending, self.pending_reduces = self.pending_reduces, []
        for reduction in pending:
            reduction.finish()

    def end_of_backward(self) -> None:
        """The framework's last callback of the backward: reduce what no post-backward did, wait, reshard."""
        with self.root._profile("fullshard::root end of backward"):
            for unit in self.units:
                unit.reduce_leftovers()
            # ZeRO-1 reduces every unit once, here, in the same order on every rank.
            for unit in reversed(self.units):
                if unit.reduces_at_end_of_backward and any(g.reduce_grads for g in unit.groups):
                    self.start_reduce(unit)
            self.complete_backward()

    def complete_backward(self) -> None:
        """Wait for the reductions in flight, then reshard or keep, as each group's policy says."""
        self.finish_reduces()
        self._after_reductions()
        for unit in self.units:
            unit.phase = TrainingPhase.IDLE
            unit.forwards_with_grad = 0
            for group in unit.groups:
                with unit.profiled("reshard"):
                    group.after_reducing_backward()
        self.end_of_backward_queued = False
        self._after_backward()

    # ------------------------------------------------------------------ failures
    def reset_step(self) -> None:
        """Abandon the step in flight (it raised): pending reductions and this step's gradients are dropped,
        every unit is resharded and shows its shards."""
        self.end_of_backward_queued = False
        for reduction in self.pending_reduces:
            reduction.abandon()
        self.pending_reduces.clear()
        for unit in self.units:
            unit.phase = TrainingPhase.IDLE
            unit.forwards_with_grad = 0
            unit._forward_done.clear()
            for group in unit.groups:
                group.abandon()


def distinct_units(modules: Iterable[Any]) -> list[Unit]:
    """The units of ``modules``, each once, in order (a group of several modules has one unit)."""
    seen, units = set(), []
    for module in modules:
        unit = getattr(module, STATE_ATTR, None)
        if unit is not None and id(unit) not in seen:
            seen.add(id(unit))
            units.append(unit)
    return units


def iter_groups(units: Iterable[Unit]) -> Iterator[Group]:
    for unit in units:
        yield from unit.groups
