"""A pass over a pickle's opcodes before it is unpickled: nothing in it may make the unpickler allocate
more than the pickle's own size, or reach an opcode plain data never needs (framework-free).

CPython's unpickler trusts counts in the stream: a byte string's length is
allocated before its bytes are read, and a memo index grows the memo table
to that index. A few flipped bytes can so ask for gigabytes from a file of
a kilobyte. :func:`check_pickle` walks the opcodes with :mod:`pickletools`
(which reads what a length announces, so a count past the end of the data
fails there) and refuses memo indices beyond the entries stored so far,
frames past the end, opcodes outside the list below, and bytes after STOP.
Which classes the pickle may build is the unpickler's business.
"""
from __future__ import annotations

import io
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


def check_pickle(data: bytes, checkpoint: Union[str, Path], file: str) -> None:
    """Raise CheckpointError unless ``data`` is one well-formed pickle that asks for nothing beyond itself."""
    stored, stopped_at = 0, None
    try:
        for opcode, arg, position in pickletools.genops(io.BytesIO(data)):
            name = opcode.name
            if name not in ALLOWED:
                raise CheckpointError.at(checkpoint, f"its pickle uses the {name} opcode at byte {position}, which "
                                         "checkpoint metadata never needs; refusing to unpickle it", file)
            if name == "MEMOIZE":
                stored += 1
            elif name in _PUTS:
                if arg > stored:
                    raise CheckpointError.at(checkpoint, f"its pickle stores memo entry {arg} at byte {position}, "
                                             f"past the {stored} stored so far", file)
                stored = max(stored, arg + 1)
            elif name == "FRAME" and arg > len(data) - position:
                raise CheckpointError.at(checkpoint, f"its pickle announces a frame of {arg} bytes at byte "
                                         f"{position}, past the end", file)
            elif name == "STOP":
                stopped_at = position
    except (ValueError, EOFError) as error:  # a length past the end, an unknown opcode, no STOP
        raise CheckpointError.at(checkpoint, f"is not a complete pickle ({str(error)[:200]})", file) from None
    if stopped_at != len(data) - 1:
        raise CheckpointError.at(checkpoint, "has bytes after the end of its pickle", file)
