"""Tensors inside the structures modules take and return (``fullshard.core.trees``, with torch tensors as leaves)."""
from __future__ import annotations

from typing import Any, Callable

import torch

from fullshard.core.trees import map_leaves, leaves_in


def map_tensors(fn: Callable[[torch.Tensor], Any], tree: Any) -> Any:
    """``tree`` with every tensor ``t`` replaced by ``fn(t)``; containers are rebuilt, others kept."""
    return map_leaves(fn, tree, torch.Tensor)


def tensors_in(tree: Any) -> list[torch.Tensor]:
    """Every tensor in ``tree``, in order, each once (nothing is rebuilt)."""
    return leaves_in(tree, torch.Tensor)
