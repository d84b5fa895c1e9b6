"""Checkpoint directories that appear complete or not at all: the rename protocol both runtimes use.

A checkpoint ``<root>/step_<N>`` is written as ``step_<N>.partial`` and
renamed only when every rank has finished. A save cut short leaves a
``.partial`` directory that :func:`latest_step` never takes, so the last
complete checkpoint stays the one a resume finds.
"""
from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Optional, Union

_COMPLETE = re.compile(r"^step_(\d+)$")


def step_dir(root: Union[str, Path], step: int) -> Path:
    return Path(root) / f"step_{step}"


def latest_step(root: Union[str, Path]) -> Optional[int]:
    """The highest ``N`` with a complete ``step_<N>`` directory under ``root`` (None when there is none)."""
    root = Path(root)
    if not root.is_dir():
        return None
    steps = [int(m.group(1)) for p in root.iterdir() if (m := _COMPLETE.match(p.name)) and p.is_dir()]
    return max(steps, default=None)


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


def partial_dir(final: Union[str, Path]) -> Path:
    final = Path(final)
    return final.with_name(final.name + ".partial")


def start_partial(final: Union[str, Path]) -> Path:
    """An empty ``<final>.partial`` directory (what an interrupted save left there is removed). One rank calls it."""
    partial = partial_dir(final)
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    return partial


def publish(final: Union[str, Path]) -> Path:
    """Rename the complete ``<final>.partial`` to ``final``; one rank calls it, after every rank wrote.

    A directory cannot be renamed over a non-empty one, so an older ``final``
    is moved aside first: until the new one is in place the old one still
    exists under some name, and ``final`` never holds a mix of both.
    """
    final = Path(final)
    partial = partial_dir(final)
    replaced = final.with_name(final.name + ".replaced")
    if final.exists():
        shutil.rmtree(replaced, ignore_errors=True)
        os.replace(final, replaced)
    os.replace(partial, final)
    fsync_dir(final.parent)
    shutil.rmtree(replaced, ignore_errors=True)
    return final


def write_file_durably(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` and fsync it (the rename that publishes it comes later)."""
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
