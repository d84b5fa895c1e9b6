"""The leaves inside the structures modules take and return: tuples, lists, dicts, namedtuples, dataclasses.

Casting inputs and outputs and hooking them for backward must reach every
tensor a module passes on, as FSDP2 does; a framework's own tree utilities
alone leave dataclass instances (common for model outputs) as opaque leaves.
Each runtime names its tensor type as the leaf type.
"""
from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from typing import Any, Callable


def _is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(x, "_fields")


def map_leaves(fn: Callable[[Any], Any], tree: Any, leaf_type: type) -> Any:
    """``tree`` with every ``leaf_type`` instance ``t`` replaced by ``fn(t)``; containers are rebuilt, others kept."""

    def walk(x: Any) -> Any:
        if isinstance(x, leaf_type):
            return fn(x)
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            changes = {f.name: walk(getattr(x, f.name)) for f in dataclasses.fields(x) if hasattr(x, f.name)}
            try:
                return dataclasses.replace(x, **{k: v for k, v in changes.items() if _init_field(x, k)})
            except (TypeError, ValueError):  # a dataclass whose __init__ does not take its fields back
                rebuilt = copy.copy(x)
                for name, value in changes.items():
                    object.__setattr__(rebuilt, name, value)
                return rebuilt
        if _is_namedtuple(x):
            return type(x)(*(walk(v) for v in x))
        if isinstance(x, (list, tuple, set)):
            return type(x)(walk(v) for v in x)
        if isinstance(x, Mapping):
            items = [(k, walk(v)) for k, v in x.items()]
            try:
                return type(x)(items)
            except TypeError:  # e.g. defaultdict, which wants its factory first
                rebuilt = copy.copy(x)
                for k, v in items:
                    rebuilt[k] = v
                return rebuilt
        return x

    return walk(tree)


def _init_field(instance: Any, name: str) -> bool:
    return next(f.init for f in dataclasses.fields(instance) if f.name == name)


def leaves_in(tree: Any, leaf_type: type) -> list:
    """Every ``leaf_type`` instance in ``tree``, in order, each once (nothing is rebuilt)."""
    found: dict[int, Any] = {}

    def visit(x: Any) -> None:
        if isinstance(x, leaf_type):
            found.setdefault(id(x), x)
        elif dataclasses.is_dataclass(x) and not isinstance(x, type):
            for f in dataclasses.fields(x):
                visit(getattr(x, f.name, None))
        elif isinstance(x, (list, tuple, set)):
            for v in x:
                visit(v)
        elif isinstance(x, Mapping):
            for v in x.values():
                visit(v)

    visit(tree)
    return list(found.values())
