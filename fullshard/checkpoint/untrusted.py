"""A checkpoint is untrusted input: the one error every reader raises, and the checks on what a checkpoint says.

A checkpoint may be damaged (a flipped bit, a file cut short by a full disk)
or crafted (someone else's checkpoint). Every reader (both runtimes'
loaders, ``export``, ``--resume``) raises :class:`CheckpointError` for
anything wrong with one, naming the checkpoint and the file, before it reads
anything into a model or writes anything. This module holds that error and
the framework-free checks both formats make before they believe a number:

- **Layout** (:func:`check_shape`, :func:`check_tiling`, :func:`check_ranges`,
  :func:`check_key_paths`): both formats describe a tensor as chunks of a
  global shape stored at byte ranges of files. Before anything is allocated
  or read, the chunks must tile the global shape exactly (inside it, not
  overlapping, covering it) and the byte ranges must lie inside their files
  without overlapping, so a tensor cannot claim more elements than its files
  hold bytes, and a crafted size cannot make a loader allocate what the files
  never contained.
- **Pickles** (:func:`check_pickle`, used on DCP's ``.metadata``): CPython's
  unpickler trusts counts in the stream (a byte string's length is allocated
  before its bytes are read; a memo index grows the memo table to that
  index), so a few flipped bytes can ask for gigabytes from a file of a
  kilobyte. The scan walks the opcodes (their argument sizes from
  :mod:`pickletools`' table, without decoding them: a plain loop, fast on
  large metadata) and refuses counts past the end of the data, memo indices
  beyond the entries stored so far, frames past the end, opcodes outside
  :data:`PICKLE_OPCODES`, and bytes after STOP. Which classes the pickle may
  build is the unpickler's business.

The checks on the files themselves (plain names, no symlinks, bounded reads)
are :mod:`fullshard.checkpoint.files`.
"""
from __future__ import annotations

import pickletools
import reprlib
from math import prod
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence, Union

_SHOW = reprlib.Repr()
_SHOW.maxstring, _SHOW.maxother, _SHOW.maxlevel = 80, 80, 3


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as it is: damaged, incomplete, crafted, or not this kind.

    ``checkpoint`` and ``file`` say where (``file`` is None for the directory
    as a whole). A ``ValueError``, so callers that caught one keep working.
    """

    def __init__(self, message: str, checkpoint: Optional[str] = None, file: Optional[str] = None) -> None:
        super().__init__(message)
        self.checkpoint, self.file = checkpoint, file

    @classmethod
    def at(cls, checkpoint: Union[str, Path], problem: str, file: Optional[str] = None) -> "CheckpointError":
        where = f"checkpoint {checkpoint}" + (f", file {file}" if file else "")
        return cls(f"{where}: {problem}", str(checkpoint), file)

    def __reduce__(self):  # DCP sends a rank's failure to the others pickled
        return (type(self), (str(self), self.checkpoint, self.file))


def show(value: Any) -> str:
    """``repr`` of a value from a checkpoint, cut short (a crafted one may be huge or deeply nested)."""
    return _SHOW.repr(value)


def is_int(value: Any) -> bool:
    """An integer and not a bool (JSON ``true`` and pickled ``True`` are ints to Python)."""
    return isinstance(value, int) and not isinstance(value, bool)


# ---------------------------------------------------------------------- layout: chunks, byte ranges, key paths
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


# ---------------------------------------------------------------------- pickles
# Containers, numbers, strings, references to classes and building objects of them: what DCP metadata uses.
PICKLE_OPCODES = frozenset({
    "PROTO", "FRAME", "STOP", "MARK", "POP", "POP_MARK", "DUP",
    "MEMOIZE", "PUT", "BINPUT", "LONG_BINPUT", "GET", "BINGET", "LONG_BINGET",
    "NONE", "NEWTRUE", "NEWFALSE", "INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4",
    "FLOAT", "BINFLOAT", "UNICODE", "BINUNICODE", "SHORT_BINUNICODE", "BINUNICODE8",
    "SHORT_BINBYTES", "BINBYTES", "BINBYTES8",
    "EMPTY_TUPLE", "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "EMPTY_LIST", "LIST", "APPEND", "APPENDS",
    "EMPTY_DICT", "DICT", "SETITEM", "SETITEMS",
    "GLOBAL", "STACK_GLOBAL", "REDUCE", "NEWOBJ", "BUILD",
})

# How many bytes announce an argument's length, and whether that count is signed.
_COUNTED = {pickletools.TAKEN_FROM_ARGUMENT1: (1, False), pickletools.TAKEN_FROM_ARGUMENT4: (4, True),
            pickletools.TAKEN_FROM_ARGUMENT4U: (4, False), pickletools.TAKEN_FROM_ARGUMENT8U: (8, False)}
_NONE, _FIXED, _LINES, _COUNTED_BYTES = range(4)


def _table() -> list:
    """Per opcode byte: (name, how its argument is sized, size or lines or length width, signed, allowed)."""
    table: list = [None] * 256
    for op in pickletools.opcodes:
        argument = op.arg
        if argument is None:
            shape = (_NONE, 0, False)
        elif argument.n >= 0:
            shape = (_FIXED, argument.n, False)
        elif argument.n == pickletools.UP_TO_NEWLINE:
            shape = (_LINES, 2 if op.name == "GLOBAL" else 1, False)  # GLOBAL: module and name
        else:
            shape = (_COUNTED_BYTES, *_COUNTED[argument.n])
        table[ord(op.code)] = (op.name, *shape, op.name in PICKLE_OPCODES)
    return table


_TABLE = _table()


def check_pickle(data: bytes, checkpoint: Union[str, Path], file: str) -> None:
    """Raise CheckpointError unless ``data`` is one well-formed pickle that asks for nothing beyond itself.

    One pass, in a plain loop (metadata of a large model has millions of opcodes).
    """
    def bad(problem: str) -> CheckpointError:
        return CheckpointError.at(checkpoint, f"its pickle {problem}; refusing to unpickle it", file)

    position, stored, end, table = 0, 0, len(data), _TABLE
    while position < end:
        start = position
        entry = table[data[position]]
        if entry is None or not entry[4]:
            raise bad(f"uses {entry[0] if entry else f'byte {data[position]:#04x}'} at byte {start}, which "
                      "checkpoint metadata never needs")
        name, shape, size, signed, _ = entry
        position += 1
        if shape == _FIXED:
            position += size
            if position > end:
                raise bad(f"is cut short in the argument of {name}")
        elif shape == _COUNTED_BYTES:
            if position + size > end:
                raise bad(f"is cut short in the length of {name}")
            length = int.from_bytes(data[position:position + size], "little", signed=signed)
            position += size
            if not 0 <= length <= end - position:
                raise bad(f"announces {length} bytes for {name} at byte {start}, but only {end - position} remain")
            position += length
        elif shape == _LINES:
            for _ in range(size):
                newline = data.find(b"\n", position)
                if newline < 0:
                    raise bad(f"is cut short in the argument of {name}")
                position = newline + 1
        if name == "STOP":
            if position != end:
                raise bad(f"ends at byte {position} of {end}: there are bytes after it")
            return
        if name in _WATCHED:
            stored = _watch(name, data, start, position, stored, bad)
    raise bad("ends without STOP (it is cut short)")


_WATCHED = frozenset({"MEMOIZE", "PUT", "BINPUT", "LONG_BINPUT", "FRAME"})


def _watch(name: str, data: bytes, start: int, position: int, stored: int, bad) -> int:
    """The opcodes whose arguments matter: memo stores and frames. Returns the memo entries stored."""
    if name == "MEMOIZE":
        return stored + 1
    argument = data[start + 1:position]
    if name == "FRAME":
        if int.from_bytes(argument, "little") > len(data) - position:
            raise bad(f"announces a frame of {int.from_bytes(argument, 'little')} bytes at byte {start}, past the end")
        return stored
    try:
        index = int(argument) if name == "PUT" else int.from_bytes(argument, "little")
    except ValueError:
        raise bad(f"has a memo index {argument[:20]!r} that is not a number") from None
    if index > stored:
        raise bad(f"stores memo entry {index} at byte {start}, past the {stored} stored so far")
    return max(stored, index + 1)
