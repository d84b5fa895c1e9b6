"""Comparing checkpoint states bit for bit: shared by the torch checkpoint tests (inside the ranks and here)."""
from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

def assert_same(actual: Any, expected: Any, path: str = "") -> None:
    """Bit-for-bit equality of nested state dicts (DTensors compared by their local shards)."""
    if isinstance(expected, dict):
        assert isinstance(actual, dict), f"{path}: {type(actual).__name__}, expected a dict"
        assert sorted(map(str, actual)) == sorted(map(str, expected)), (
            f"{path}: keys {sorted(map(str, actual))} vs {sorted(map(str, expected))}"
        )
        for key in expected:
            assert_same(actual[key], expected[key], f"{path}.{key}" if path else str(key))
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), f"{path}: length {len(actual)} vs {len(expected)}"
        for index, (a, e) in enumerate(zip(actual, expected)):
            assert_same(a, e, f"{path}[{index}]")
    elif isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{path}: {type(actual).__name__}, expected a tensor"
        if isinstance(expected, DTensor):
            assert isinstance(actual, DTensor) and actual.placements == expected.placements, f"{path}: placements"
            actual, expected = actual.to_local(), expected.to_local()
        assert actual.shape == expected.shape and actual.dtype == expected.dtype, (
            f"{path}: {tuple(actual.shape)} {actual.dtype} vs {tuple(expected.shape)} {expected.dtype}"
        )
        assert torch.equal(actual, expected), f"{path}: values differ"
    else:
        assert actual == expected, f"{path}: {actual!r} vs {expected!r}"
