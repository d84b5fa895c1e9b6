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

from typing import Any, Callable, Iterable

from fullshard.core.lifecycle import STATE_ATTR

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


def configure_groups(units: Iterable[Any], values: dict[str, Any]) -> None:
    """Set ``values`` on every group of ``units`` (an FSDPModule setter reaching every group in reach)."""
    for unit in units:
        for group in unit.groups:
            for name, value in values.items():
                setattr(group, name, value)


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
