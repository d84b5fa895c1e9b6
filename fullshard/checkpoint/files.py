"""A checkpoint's files on disk: written so that they survive a crash, read without trusting their names.

Writing: a file is fsynced before the rename that publishes its directory,
and the rename is fsynced in its parent (:func:`write_file_durably`,
:func:`fsync_dir`), so once a save returned, a crash cannot take it back.

Reading: file names come from the checkpoint, so each must be a plain name
inside its directory (:func:`plain_file_name`), and the file a regular one:
a symlink inside a checkpoint is refused whatever it points to, checked
with ``lstat`` and opened with ``O_NOFOLLOW`` (the directory itself may be
reached through symlinks; the user chose that path). Whole-file reads are
bounded (:func:`read_whole`). Anything wrong is a
:class:`~fullshard.checkpoint.untrusted.CheckpointError` naming the file.
"""
from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any, Union

from fullshard.checkpoint.untrusted import CheckpointError, show

# Longer names are not plain names on common file systems.
_MAX_NAME = 255
# Characters that make a name a path on some platform (":" a Windows drive or stream).
_PATH_CHARACTERS = frozenset("/\\:\0")


# ---------------------------------------------------------------------- writing
def fsync_dir(path: Path) -> None:
    """Make a rename in ``path`` durable (POSIX); a no-op where directories cannot be opened."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_file_durably(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` and fsync it (the rename that publishes it comes later)."""
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


# ---------------------------------------------------------------------- reading
def plain_file_name(name: Any, checkpoint: Union[str, Path], what: str) -> str:
    """``name`` itself when it names a file directly inside the checkpoint directory; else CheckpointError."""
    if (not isinstance(name, str) or not name or len(name) > _MAX_NAME or name in (".", "..")
            or any(c in _PATH_CHARACTERS for c in name)):
        raise CheckpointError.at(
            checkpoint, f"{what} {show(name)} is not a plain file name inside the checkpoint directory "
            "(no separators, '..', absolute paths or drives): refusing a checkpoint that points outside itself")
    return name


def regular_file(directory: Path, name: str, checkpoint: Union[str, Path]) -> os.stat_result:
    """The ``lstat`` of ``directory / name``, which must exist as a regular file (not a symlink)."""
    try:
        info = os.lstat(directory / name)
    except FileNotFoundError:
        raise CheckpointError.at(checkpoint, "is missing (the checkpoint is incomplete)", name) from None
    except OSError as error:
        raise CheckpointError.at(checkpoint, f"cannot be read ({error.strerror})", name) from None
    if stat.S_ISLNK(info.st_mode):
        raise CheckpointError.at(checkpoint, "is a symlink; fullshard refuses symlinks inside a checkpoint "
                                 "(copy the file in instead)", name)
    if not stat.S_ISREG(info.st_mode):
        raise CheckpointError.at(checkpoint, "is not a regular file", name)
    return info


def open_regular(directory: Path, name: str, checkpoint: Union[str, Path]):
    """``directory / name`` opened for reading without following a symlink (one swapped in after a check)."""
    regular_file(directory, name, checkpoint)
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        return os.fdopen(os.open(directory / name, flags), "rb")
    except OSError as error:
        raise CheckpointError.at(checkpoint, f"cannot be opened ({error.strerror})", name) from None


def read_whole(directory: Path, name: str, checkpoint: Union[str, Path], limit: int) -> bytes:
    """All of ``directory / name`` (a regular file of at most ``limit`` bytes), read in one go."""
    with open_regular(directory, name, checkpoint) as handle:
        size = os.fstat(handle.fileno()).st_size
        if size > limit:
            raise CheckpointError.at(checkpoint, f"is {size} bytes, more than the {limit} such a file may have", name)
        try:
            data = handle.read(size + 1)
        except OSError as error:
            raise CheckpointError.at(checkpoint, f"cannot be read ({error.strerror})", name) from None
    if len(data) != size:
        raise CheckpointError.at(checkpoint, "changed size while it was read", name)
    return data
