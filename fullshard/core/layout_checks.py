"""Checks on where a checkpoint says its data lies, against what its files hold (framework-free).

Both formats describe a tensor as chunks of a global shape stored at byte
ranges of files. Before anything is allocated or read, the chunks must tile
the global shape exactly (inside it, not overlapping, covering it), and the
byte ranges must lie inside their files without overlapping. So a tensor
cannot claim more elements than its files hold bytes, and a crafted size
cannot make a loader allocate what the files never contained.
"""
from __future__ import annotations

from math import prod
from pathlib import Path
from typing import Any, Iterable, Sequence, Union

from fullshard.core.untrusted import CheckpointError, is_int, show

MAX_DIMS = 64
# A nested state dict deeper than this is not one fullshard or DCP writes.
MAX_PATH_DEPTH = 64

Chunk = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)


def check_shape(shape: Any, checkpoint: Union[str, Path], what: str) -> tuple[int, ...]:
    """``shape`` as a tuple of sizes (a list or tuple of at most MAX_DIMS non-negative ints)."""
    if (not isinstance(shape, (list, tuple)) or len(shape) > MAX_DIMS
            or not all(is_int(s) and 0 <= s < 1 << 62 for s in shape)):
        raise CheckpointError.at(checkpoint, f"{what} has shape {show(shape)}, not a list of at most {MAX_DIMS} "
                                 "non-negative sizes")
    return tuple(shape)


def check_tiling(shape: tuple[int, ...], chunks: Sequence[Chunk], checkpoint: Union[str, Path], what: str) -> None:
    """The chunks lie inside ``shape``, do not overlap and cover it."""
    for offsets, sizes in chunks:
        if (len(offsets) != len(shape) or len(sizes) != len(shape)
                or not all(is_int(o) and is_int(s) and o >= 0 and s >= 0 and o + s <= n
                           for o, s, n in zip(offsets, sizes, shape))):
            raise CheckpointError.at(checkpoint, f"{what}: the chunk at offsets {show(offsets)} of sizes "
                                     f"{show(sizes)} is not inside its shape {shape}")
    covered = sum(prod(sizes) for _, sizes in chunks)
    if covered != prod(shape):
        raise CheckpointError.at(checkpoint, f"{what}: its chunks hold {covered} elements, its shape {shape} "
                                 f"has {prod(shape)}")
    overlap = _first_overlap([c for c in chunks if prod(c[1])])
    if overlap is not None:
        raise CheckpointError.at(checkpoint, f"{what}: the chunks at offsets {overlap[0][0]} and {overlap[1][0]} "
                                 "overlap")


def _first_overlap(chunks: list[Chunk]):
    """Two overlapping chunks, found by a sweep along the dim the chunks are cut along most (near linear for shards)."""
    if len(chunks) < 2:
        return None
    ndim = len(chunks[0][0])
    dim = max(range(ndim), key=lambda d: len({c[0][d] for c in chunks}))
    active: list[Chunk] = []
    for chunk in sorted(chunks, key=lambda c: c[0][dim]):
        start = chunk[0][dim]
        active = [a for a in active if a[0][dim] + a[1][dim] > start]
        for other in active:
            if all(o1 < o2 + s2 and o2 < o1 + s1
                   for o1, s1, o2, s2 in zip(chunk[0], chunk[1], other[0], other[1])):
                return other, chunk
        active.append(chunk)
    return None


def check_ranges(file: str, size: int, ranges: Iterable[tuple[int, int, str]], checkpoint: Union[str, Path]) -> None:
    """The byte ranges ``(offset, length, what)`` fill ``file`` (``size`` bytes) exactly, one after the other.

    That is how DCP writes its files (each item where the last one ended), so
    a length or offset changed in the metadata cannot go unnoticed.
    """
    ranges = list(ranges)
    for offset, length, what in ranges:
        if not (is_int(offset) and is_int(length) and offset >= 0 and length >= 0 and offset + length <= size):
            raise CheckpointError.at(checkpoint, f"{what} is stored at bytes {show(offset)}+{show(length)}, not inside "
                                     f"the file ({size} bytes)", file)
    end, last = 0, "the start of the file"
    for offset, length, what in sorted(ranges, key=lambda r: (r[0], r[1])):
        if offset != end:
            raise CheckpointError.at(checkpoint, f"{what} is stored from byte {offset}, but {last} ends at byte {end} "
                                     "(a gap or an overlap)", file)
        end, last = offset + length, what
    if end != size:
        raise CheckpointError.at(checkpoint, f"its stored items end at byte {end}, the file has {size} bytes", file)


def check_key_paths(paths: dict[str, tuple], checkpoint: Union[str, Path], file: str) -> None:
    """Key paths (``("optim", "param_groups", 0, "lr")``) that build one nested state dict without conflicts.

    Each path is a non-empty tuple of str (dict keys) and int (list indices),
    at most MAX_PATH_DEPTH long, starting with a str; an index is below the
    number of paths (so no list grows past what the checkpoint holds); no
    path is a prefix of another, and one container never takes both kinds of
    key.
    """
    limit = len(paths)
    tree: dict = {}
    for name, path in paths.items():
        if (not isinstance(path, tuple) or not path or len(path) > MAX_PATH_DEPTH or not isinstance(path[0], str)
                or not all(isinstance(k, str) or (is_int(k) and 0 <= k < limit) for k in path)):
            raise CheckpointError.at(checkpoint, f"the key path of {show(name)} is {show(path)}: not a tuple of up to "
                                     f"{MAX_PATH_DEPTH} names and indices below {limit}", file)
        node = tree
        for depth, key in enumerate(path):
            kind = "index" if is_int(key) else "name"
            if node.setdefault(None, kind) != kind:
                raise CheckpointError.at(checkpoint, f"the key path of {show(name)} puts a {kind} where another "
                                         "path has the other kind", file)
            last = depth == len(path) - 1
            child = node.get(key)
            if child is not None and (last or child is _LEAF):
                raise CheckpointError.at(checkpoint, f"the key path of {show(name)} collides with another one", file)
            if last:
                node[key] = _LEAF
            else:
                node = node.setdefault(key, {})


_LEAF = object()
