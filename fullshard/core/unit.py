"""The life of a sharded unit in a training step, written once for every runtime: its phases and its root's.

A *unit* is what one ``fully_shard`` call leaves on a module (torch) or cell (MindSpore), under
:data:`UNIT_ATTR`: the groups of parameters it gathers and reduces (``fullshard.core.group``), and its place in
a root's step. The runtime's hooks call the transitions below when its framework reaches them; the rules about
what happens then (gather or not, keep or reshard, reduce now or at the end of backward, prefetch whom, how a
failed step is abandoned) live here and in ``core/group.py``. Where a framework decides something itself (when
MindSpore's autograd hands a gradient over, when torch's runs the end-of-backward callback), the runtime's
``unit.py`` says so. A runtime subclasses :class:`Unit` and :class:`Root` and supplies its framework's
operations: the methods that raise ``NotImplementedError`` here.

Phases of a unit (:class:`TrainingPhase`) and the events that move it (:data:`TRANSITIONS`, drawn in
``docs/design.md``)::

    IDLE --pre-forward--> PRE_FORWARD --gathered--> FORWARD --post-forward--> IDLE
    IDLE --pre-backward--> PRE_BACKWARD --post-backward--> POST_BACKWARD --end of backward--> IDLE

A unit used twice in one forward goes through PRE_BACKWARD / POST_BACKWARD once per use (on MindSpore, whose
autograd sums the uses before it hands them over, once); the root's end of backward returns every unit to
IDLE, and abandoning a step (it raised) does too, from any phase.
"""
from __future__ import annotations

import contextlib
import enum
import threading
from typing import Any, Callable, Iterable, Optional

from fullshard.core.group import GatherState, Group
from fullshard.plan.group import AfterBackward, Lifecycle, lifecycle

UNIT_ATTR = "_fullshard_unit"  # where a module or cell keeps its unit

Named = Iterable[tuple[str, Any]]


class TrainingPhase(enum.Enum):
    IDLE = "idle"
    PRE_FORWARD = "pre-forward"
    FORWARD = "forward"
    PRE_BACKWARD = "pre-backward"
    POST_BACKWARD = "post-backward"

    def __str__(self) -> str:
        return self.value


# (from, event, to): every move of a unit's phase this module makes (tests/core/test_lifecycle.py records each move
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


class Unit:
    """One ``fully_shard`` call's place in a step: its phase, its groups, how it finds its root. A runtime's
    unit subclasses it, sets :attr:`root_class` and :attr:`active`, provides :meth:`_named_submodules`,
    and calls the transitions from its framework's hooks."""

    root_class: type  # the runtime's Root
    active: Any  # a threading.local; ``.unit``: the root unit whose forward runs in this thread
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
        self.root: Optional[Root] = None  # the root's step state, once a root forward ran
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
        if self.root is not None:
            return self.root
        root = self.root_class(self)
        self.root, self.is_root = root, True
        for name, sub in self._named_submodules():
            unit = getattr(sub, UNIT_ATTR, None)
            if unit is not None and unit not in root.units:
                root.adopt(name, unit)  # also takes over a unit that ran alone before
        # Before the first gather: every unit's settings, also those of units that gather later in the step.
        root.check_agreement(root.units)
        return root

    def ensure_root(self) -> "Root":
        """A unit outside its root's modules (called from the root's forward) joins the active root, whose check
        did not describe it: the ranks compare its settings before its first gather."""
        if self.root is None:
            active = getattr(self.active, "unit", None)
            if active is not None and active.root is not None:
                active.root.adopt("", self)
                active.root.check_agreement([self])
            else:
                self.lazy_init_as_root()
        return self.root

    def enter_root_forward(self) -> bool:
        """At a forward that no other root's forward encloses: this unit is the root of the step that begins.
        False when another root's forward runs (this unit is one of its units)."""
        if getattr(self.active, "unit", None) is not None:
            return False
        self.lazy_init_as_root()
        self.active.unit = self
        self.root.begin_step()
        return True

    def leave_root_forward(self) -> None:
        if getattr(self.active, "unit", None) is self:
            if self.root is not None and self is self.root.unit:
                self.root.finish_forward()
            self.active.unit = None

    # ------------------------------------------------------------------ forward
    def pre_forward(self, prefetch: bool) -> None:
        """Gather (issuing the next unit's gathers first when ``prefetch``), then the forward computes."""
        if self.groups:
            root = self.ensure_root()  # may compare this unit across ranks first: it raises in IDLE
            self.phase = TrainingPhase.PRE_FORWARD
            root.record_forward(self, ended=False)
            with self.profiled("all-gather"):
                for group in self.groups:
                    group.use_in_forward()
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
            self.root.record_forward(self, ended=True)
            self.release_after_forward()
        self.phase = TrainingPhase.IDLE

    def release_after_forward(self) -> None:
        """After forward, keep what backward needs, as the policy says. Without a forward whose outputs need a
        gradient since the last backward, no backward is to come: the modules show their shards again, so a
        write through the parameters lands in the shards and the next forward gathers it (into the storage
        kept, when the policy keeps it)."""
        with self.profiled("reshard"):
            for group in self.groups:
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
        if not self.is_root and not any(g.state is GatherState.KEPT for g in self.groups):
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
        self.root.queue_end_of_backward()
        self.phase = TrainingPhase.PRE_BACKWARD
        with self.profiled("all-gather"):
            for group in self.groups:
                if group.unshard_in_backward:
                    group.unshard()
                group.before_backward()
            # A unit of several modules whose forward ran only some of them (a chunked loss calls the head alone,
            # a backward per chunk): that backward ends at this unit and its end reshards what a prefetch
            # gathered, again for every chunk. FSDP2 hooks no pre-backward to such a forward: no prefetch.
            if not self._forward_done:
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
        return self.root.neighbour(self, offset) if implicit else []

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
            self.root.start_reduce(self)
        for group in self.groups:
            group.after_backward_pass()
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
                self.root.start_reduce(self)
        elif any(g.has_pending_grads() for g in self.groups):
            self.phase = TrainingPhase.POST_BACKWARD
            self.root.start_reduce(self)

    def reduce_accumulated_grads(self) -> None:
        """Reduce this unit's accumulated gradients now, outside autograd (torch.distributed.pipelining does
        this after its last micro-batch, then completes the backward on the stage's root)."""
        if any(g.reduce_grads for g in self.groups):
            self.phase = TrainingPhase.POST_BACKWARD
            (self.root or self.lazy_init_as_root()).start_reduce(self)

    def reset_step(self) -> None:
        """FSDPModule.reset_iter_state: abandon the step in flight (call on the root)."""
        (self.root or self.root_class(self)).reset_step()
        self.active.unit = None


class Root:
    """What only the root of a model knows: its units in order, the reductions in flight, the end of backward.

    The first sharded module whose forward runs while no other is running is the root of that forward; at its
    first forward it adopts every unit below it, which then point to it. A runtime subclasses it with how to
    queue the end-of-backward callback and how ranks compare what they wrapped.
    """

    def __init__(self, unit: Unit) -> None:
        self.unit = unit  # the root unit
        self.units: list[Unit] = [unit]  # every unit under the root, in module order
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
        """Fail on every rank if ranks set up ``units`` differently (``fullshard.core.checks``)."""
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
        unit.root, unit.is_root = self, False
        for group in unit.groups:
            group.rename(name)  # errors and labels name parameters from the root

    def check_agreement(self, units: list[Unit]) -> None:
        """Compare ``units`` across ranks; if they differ, they leave this root (the next forward checks again)."""
        try:
            self.check_ranks_agree(units)
        except Exception:
            for unit in units:
                unit.root, unit.is_root = None, None
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
        with self.unit._profile("fullshard::root end of backward"):
            self.reduce_what_is_left()
            self.complete_backward()

    def reduce_what_is_left(self) -> None:
        """Start reducing what no post-backward did (also where a caller finalizes the step itself)."""
        for unit in self.units:
            unit.reduce_leftovers()
        # ZeRO-1 reduces every unit once, here, in the same order on every rank.
        for unit in reversed(self.units):
            if unit.reduces_at_end_of_backward and any(g.reduce_grads for g in unit.groups):
                self.start_reduce(unit)

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
        unit = getattr(module, UNIT_ATTR, None)
        if unit is not None and id(unit) not in seen:
            seen.add(id(unit))
            units.append(unit)
    return units


def named_under(tops: list[Any], named_modules: Callable[[Any], Named]) -> Named:
    """(path, module) of every module under ``tops``, each top included; with several tops (one group of
    several modules), paths start with ``[i].`` as parameter paths do."""
    for index, top in enumerate(tops):
        prefix = f"[{index}]." if len(tops) > 1 else ""
        for name, sub in named_modules(top):
            yield (f"{prefix}{name}" if name else prefix.rstrip(".")), sub


def become_fsdp_module(module: Any, mixin: type, classes: dict[type, type], unit: Unit,
                       set_attr: Callable = setattr) -> None:
    """Give ``module`` its unit and the methods an FSDP module has: a dynamic subclass
    ``FSDP<Class>(mixin, Class)``, made once per class."""
    set_attr(module, UNIT_ATTR, unit)
    cls = type(module)
    if cls not in classes:
        classes[cls] = type(f"FSDP{cls.__name__}", (mixin, cls), {})
    module.__class__ = classes[cls]
