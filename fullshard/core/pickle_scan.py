"""A pass over a pickle's opcodes before it is unpickled: nothing in it may make the unpickler allocate
more than the pickle's own size, or reach an opcode plain data never needs (framework-free).

CPython's unpickler trusts counts in the stream: a byte string's length is
allocated before its bytes are read, and a memo index grows the memo table
to that index. A few flipped bytes can so ask for gigabytes from a file of
a kilobyte. :func:`check_pickle` walks the opcodes (their argument sizes
from :mod:`pickletools`' table, without decoding them: a plain loop, fast
on large metadata) and refuses counts past the end of the data, memo
indices beyond the entries stored so far, frames past the end, opcodes
outside the list below, and bytes after STOP. Which classes the pickle may
build is the unpickler's business.
"""
from __future__ import annotations

import pickletools
from pathlib import Path
from typing import Union

from fullshard.core.untrusted import CheckpointError

# Containers, numbers, strings, references to classes and building objects of them: what DCP metadata uses.
ALLOWED = frozenset({
    "PROTO", "FRAME", "STOP", "MARK", "POP", "POP_MARK", "DUP",
    "MEMOIZE", "PUT", "BINPUT", "LONG_BINPUT", "GET", "BINGET", "LONG_BINGET",
    "NONE", "NEWTRUE", "NEWFALSE", "INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4",
    "FLOAT", "BINFLOAT", "UNICODE", "BINUNICODE", "SHORT_BINUNICODE", "BINUNICODE8",
    "SHORT_BINBYTES", "BINBYTES", "BINBYTES8",
    "EMPTY_TUPLE", "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "EMPTY_LIST", "LIST", "APPEND", "APPENDS",
    "EMPTY_DICT", "DICT", "SETITEM", "SETITEMS",
    "GLOBAL", "STACK_GLOBAL", "REDUCE", "NEWOBJ", "BUILD",
})
_PUTS = frozenset({"PUT", "BINPUT", "LONG_BINPUT"})


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
        table[ord(op.code)] = (op.name, *shape, op.name in ALLOWED)
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
