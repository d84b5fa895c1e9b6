"""What both runtimes' ``fully_shard`` units do alike, framework-free.

A unit is the state ``fully_shard`` leaves on a module (torch) or cell
(MindSpore), under the attribute :data:`STATE_ATTR`. The runtimes differ in
how they hook a forward and a backward; they agree on how parameters are
found, how a unit finds its root, how settings reach a unit's groups and
how buckets are named. Each of those lives here once; a runtime hands in
the few framework calls it needs (how to list a module's parameters and
children, how to build its root context).
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

from fullshard.core.lifecycle import STATE_ATTR, TrainingPhase

Named = Iterable[tuple[str, Any]]


def owners_of_params(
    tops: list[Any],
    own_params: Callable[[Any], Named],
    children: Callable[[Any], Named],
    ignored: frozenset[int] = frozenset(),
) -> tuple[dict[int, list[tuple[Any, str, str]]], dict[int, Any]]:
    """Every (module, attribute name, path) holding each parameter under ``tops``, by ``id``.

    Modules that are units already (their own ``fully_shard`` ran) are skipped
    with everything below them, and so are the parameters in ``ignored``. A
    parameter held by several modules (tied weights) lists each holder. With
    several tops (one group of several modules), paths start with ``[i].``.
    """
    owners: dict[int, list[tuple[Any, str, str]]] = {}
    params: dict[int, Any] = {}

    def visit(module: Any, prefix: str, is_top: bool) -> None:
        if not is_top and hasattr(module, STATE_ATTR):
            return
        for name, param in own_params(module):
            if param is None or id(param) in ignored:
                continue
            params[id(param)] = param
            owners.setdefault(id(param), []).append((module, name, prefix + name))
        for child_name, child in children(module):
            if child is not None:
                visit(child, f"{prefix}{child_name}.", False)

    for index, top in enumerate(tops):
        visit(top, f"[{index}]." if len(tops) > 1 else "", True)
    return owners, params


def named_under(tops: list[Any], named_modules: Callable[[Any], Named]) -> Named:
    """(path, module) of every module under ``tops``, each top included; with several tops (one group of
    several modules), paths start with ``[i].`` as parameter paths do."""
    for index, top in enumerate(tops):
        prefix = f"[{index}]." if len(tops) > 1 else ""
        for name, sub in named_modules(top):
            yield (f"{prefix}{name}" if name else prefix.rstrip(".")), sub


def distinct_states(modules: Iterable[Any]) -> list[Any]:
    """The units of ``modules``, each once, in order (a group of several modules has one state)."""
    seen, states = set(), []
    for module in modules:
        state = getattr(module, STATE_ATTR, None)
        if state is not None and id(state) not in seen:
            seen.add(id(state))
            states.append(state)
    return states


def configure_groups(units: Iterable[Any], values: dict[str, Any]) -> None:
    """Set ``values`` on every group of ``units`` (a runtime whose groups hold every setting)."""
    for unit in units:
        for group in unit.groups:
            for name, value in values.items():
                setattr(group, name, value)


def configure(states: Iterable[Any], part: str, values: dict[str, Any]) -> None:
    """Set ``values`` on one part ("group", "unsharder" or "reducer") of every group of ``states``."""
    for state in states:
        for group in state.groups:
            target = group if part == "group" else getattr(group, part)
            for name, value in values.items():
                setattr(target, name, value)


class RootedUnit:
    """How a unit finds its root: the root's first forward adopts every unit below it.

    A runtime's unit state subclasses this, sets the two class attributes and
    provides ``lifecycle`` and :meth:`_named_submodules`; ``__init__`` holds the
    state every unit has, whatever its framework.
    """

    root_context: type  # the runtime's RootContext: RootContext(root_state)
    active: Any  # a threading.local; ``.root``: the root whose forward runs in this thread

    def __init__(self, mp_policy: Any, strategy: Any, reshard_after_forward: Optional[bool]) -> None:
        self.mp_policy = mp_policy
        self.strategy = strategy
        self._reshard_after_forward = reshard_after_forward
        self.phase = TrainingPhase.IDLE
        self.is_root = None
        self.context = None  # the root's, once a root forward ran
        # Explicit prefetch targets (set_modules_to_*_prefetch); empty: the implicit
        # neighbour in the order the root recorded during its first forward.
        self.forward_prefetch: list[Any] = []
        self.backward_prefetch: list[Any] = []
        self._forward_done: set[int] = set()  # modules of this unit whose forward ran in this pass
        # Forwards since the last end of backward whose outputs need a gradient: their backward is to come.
        self.forwards_with_grad = 0

    def _named_submodules(self) -> Named:
        """(path, module) of every module under this unit's, itself included (see :func:`named_under`)."""
        raise NotImplementedError

    @property
    def reshard_after_forward(self) -> bool:
        return self.lifecycle.reshard_after_forward

    @reshard_after_forward.setter
    def reshard_after_forward(self, value: bool) -> None:
        self._reshard_after_forward = value

    def _lazy_init_as_root(self) -> Any:
        if self.context is not None:
            return self.context
        context = self.root_context(self)
        self.context, self.is_root = context, True
        for name, sub in self._named_submodules():
            state = getattr(sub, STATE_ATTR, None)
            if state is not None and state not in context.states:
                context.adopt(name, state)  # also takes over a unit that ran alone before
        try:
            context.check_ranks_agree()
        except Exception:
            for state in context.states:  # undone: the next forward checks again
                state.context, state.is_root = None, None
            raise
        return context

    def _ensure_context(self) -> Any:
        """A unit outside its root's modules (called from the root's forward) joins the active root."""
        if self.context is None:
            root = getattr(self.active, "root", None)
            if root is not None and root.context is not None:
                root.context.adopt("", self)
            else:
                self._lazy_init_as_root()
        return self.context


class BucketNames:
    """Names of a group's parameters and buckets, by their path from the root (a runtime's GroupPlan mixin).

    Needs ``params`` (each with ``fqn`` and ``local_fqn``), ``buckets`` (each
    with ``members``) and ``module_name``; ``owner_kind`` says "module" or "cell".
    """

    owner_kind = "module"

    def members(self, index: int) -> list[Any]:
        return [self.params[i] for i in self.buckets[index].members]

    def rename(self, module_fqn: str) -> None:
        """Name the parameters from the root's paths (known when the root's first forward adopts the unit)."""
        if self.module_name == module_fqn or not module_fqn:
            return
        for param in self.params:
            param.fqn = f"{module_fqn}.{param.local_fqn}"
        self.module_name = module_fqn
        self._name_buckets()

    def _name_buckets(self) -> None:
        self.labels = [self._label(b.members) for b in self.buckets]

    def _label(self, members: tuple[int, ...]) -> str:
        names = ", ".join(self.params[i].fqn for i in members[:3])
        more = f" and {len(members) - 3} more" if len(members) > 3 else ""
        return f"[{names}{more}] of {self.owner_kind} '{self.module_name}'"
