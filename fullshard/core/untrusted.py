"""What every checkpoint reader shares: the one error for a bad checkpoint, and the checks on the files it names.

A checkpoint is untrusted input: a file may be damaged, cut short, or
crafted. Every reader (both runtimes' loaders, ``export``, ``--resume``)
raises :class:`CheckpointError` for anything wrong with one, naming the
checkpoint and the file, before it reads anything into a model or writes
anything. File names come from the checkpoint, so each must be a plain name
inside its directory, and the file a regular one: a symlink inside a
checkpoint is refused whatever it points to (the directory itself may be
reached through symlinks; the user chose that path).
"""
from __future__ import annotations

import os
import reprlib
import stat
from pathlib import Path
from typing import Any, Optional, Union

# Longer names are not plain names on common file systems.
_MAX_NAME = 255
# Characters that make a name a path on some platform (":" a Windows drive or stream).
_PATH_CHARACTERS = frozenset("/\\:\0")
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
