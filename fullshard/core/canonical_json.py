"""JSON documents in exactly one byte form: sorted keys, no spaces, ASCII.

Every JSON document fullshard writes into a checkpoint is canonical, and a
reader refuses one whose bytes are not exactly the canonical form of what
they parse to. So no byte of such a file can change without being noticed:
not a space, not a duplicated key, not ``1.0`` written as ``1e0``.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Union

from fullshard.core.untrusted import CheckpointError


def dumps(document: Any) -> bytes:
    """The canonical bytes of ``document`` (plain JSON data: no NaN or infinity)."""
    return json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                      allow_nan=False).encode("ascii")


def loads(data: bytes, checkpoint: Union[str, Path], file: str) -> Any:
    """The document ``data`` holds; CheckpointError unless ``data`` is valid JSON in canonical form."""
    try:
        document = json.loads(data.decode("ascii"))
    except (UnicodeDecodeError, ValueError, RecursionError) as error:
        raise CheckpointError.at(checkpoint, f"is not valid JSON ({_first_line(error)})", file) from None
    try:
        canonical = dumps(document)
    except (ValueError, TypeError, RecursionError):
        canonical = None  # NaN, infinity or nesting past what fullshard writes
    if canonical != data:
        raise CheckpointError.at(checkpoint, "is not in the canonical JSON form fullshard writes (sorted keys, no "
                                 "spaces): it was changed or damaged after it was saved", file)
    return document


def _first_line(error: BaseException) -> str:
    return (str(error).splitlines() or [type(error).__name__])[0][:200]
