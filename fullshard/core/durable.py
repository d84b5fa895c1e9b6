"""Writes that survive a crash once they returned: files and renames fsynced."""
from __future__ import annotations

import os
from pathlib import Path


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
