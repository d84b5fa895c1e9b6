"""Checkpoint directories that are always found complete: the rename protocol both runtimes use.

A checkpoint ``<root>/step_<N>`` is written as ``step_<N>.partial``; once
every rank has finished, the manifest (:mod:`fullshard.core.manifest`) is
written into it and :func:`publish` renames it into place. A directory
cannot be renamed over a non-empty one, so publishing over an older
checkpoint takes steps, and at every instant one of these holds:

- ``step_<N>`` is a complete checkpoint (the old one or the new one), or
- ``step_<N>`` is absent and a complete one is beside it: the new one as a
  ``.partial`` whose manifest verifies, or the old one as ``.replaced``.

:func:`resolve` (used by every loader, ``export`` and ``--resume``) and
:func:`latest_step` apply that rule, so a crash anywhere in a save leaves a
checkpoint that loads; :func:`resolve` warns when it takes the one beside.
A save cut short before its manifest leaves a ``.partial`` that is never
taken and that the next save of that step removes. :func:`save_together` runs
the protocol across ranks, so that a failure on one rank raises on all.
"""
from __future__ import annotations

import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Callable, Optional, Union

from fullshard.core import manifest
from fullshard.core.durable import fsync_dir
from fullshard.core.agreement import Ranks
from fullshard.core.rank_failures import run_together
from fullshard.core.untrusted import CheckpointError

_STEP = re.compile(r"^step_(\d+)(\.partial|\.replaced)?$")


class RecoveredCheckpointWarning(UserWarning):
    """A checkpoint was missing at its path and the complete copy an interrupted save left beside it was used."""


def step_dir(root: Union[str, Path], step: int) -> Path:
    return Path(root) / f"step_{step}"


def partial_dir(final: Union[str, Path]) -> Path:
    final = Path(final)
    return final.with_name(final.name + ".partial")


def replaced_dir(final: Union[str, Path]) -> Path:
    final = Path(final)
    return final.with_name(final.name + ".replaced")


def _beside(final: Path) -> Optional[Path]:
    """The complete copy a save interrupted while publishing left beside ``final`` (None if there is none)."""
    for candidate in (partial_dir(final), replaced_dir(final)):  # the new save first, then the old one
        if candidate.is_dir() and manifest.present(candidate):
            try:
                manifest.verify(candidate)
            except CheckpointError:
                continue
            return candidate
    return None


def resolve(final: Union[str, Path]) -> Path:
    """The directory to load checkpoint ``final`` from: ``final`` itself, or the complete copy beside it.

    Warns (:class:`RecoveredCheckpointWarning`, naming both paths) when
    ``final`` is missing and a copy is used. When there is none, returns
    ``final``: the caller reports it missing.
    """
    final = Path(final)
    if os.path.lexists(final):
        return final
    found = _beside(final)
    if found is None:
        return final
    warnings.warn(RecoveredCheckpointWarning(
        f"checkpoint {final} is missing: a save was interrupted while it replaced it; using the complete "
        f"checkpoint {found} it left beside it"), stacklevel=2)
    return found


def latest_step(root: Union[str, Path]) -> Optional[int]:
    """The highest ``N`` whose checkpoint ``step_<N>`` under ``root`` :func:`resolve` finds complete."""
    root = Path(root)
    if not root.is_dir():
        return None
    steps = set()
    for path in root.iterdir():
        match = _STEP.match(path.name)
        if match is None or not path.is_dir():
            continue
        step = int(match.group(1))
        if match.group(2) is None or (step not in steps and not step_dir(root, step).exists()
                                      and _beside(step_dir(root, step)) is not None):
            steps.add(step)
    return max(steps, default=None)


def start_partial(final: Union[str, Path]) -> Path:
    """An empty ``<final>.partial`` directory (what an interrupted save left there is removed). One rank calls it.

    A checkpoint published before stays complete at ``final`` or as ``.replaced`` until :func:`publish`
    has put the new one in place; a complete ``.partial`` removed here is one whose save never
    finished publishing, which this save replaces.
    """
    partial = partial_dir(final)
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    return partial


def publish(final: Union[str, Path]) -> Path:
    """Rename the complete ``<final>.partial`` (its manifest written) to ``final``; one rank calls it.

    The steps, and what a crash after each leaves (see the module doc):
    1. remove a ``.replaced`` left by an earlier crash (``final`` is complete);
    2. rename the old ``final`` to ``.replaced`` (now ``final`` is absent: the
       ``.partial`` is complete and verified, ``.replaced`` is complete);
    3. rename the ``.partial`` to ``final`` and fsync the parent directory;
    4. remove ``.replaced``.
    """
    final = Path(final)
    partial, replaced = partial_dir(final), replaced_dir(final)
    if not (partial / manifest.MANIFEST_FILE).is_file():
        raise RuntimeError(f"publish: {partial} has no {manifest.MANIFEST_FILE}; write it once every rank finished")
    if os.path.lexists(final):
        if os.path.lexists(replaced):
            shutil.rmtree(replaced)
        os.replace(final, replaced)
    os.replace(partial, final)
    fsync_dir(final.parent)
    if os.path.lexists(replaced):
        shutil.rmtree(replaced)
    return final


def save_together(final: Union[str, Path], ranks: Ranks, write_files: Callable[[Path], object],
                  write_manifest: Callable[[Path], object], caller: str) -> Path:
    """Save checkpoint ``final`` on every rank of ``ranks``: rank 0 starts the ``.partial``, every rank's
    ``write_files(partial)`` writes its part, then rank 0's ``write_manifest(partial)`` and :func:`publish`.

    Every rank calls it. Each part ends with the ranks telling each other how it went (one all-reduce,
    which also orders the parts), so a failure on any rank raises
    :class:`~fullshard.core.rank_failures.RanksFailed` on every rank at once, naming that rank and its
    error, instead of leaving the others in the next collective until the process group times out.
    """
    final = Path(final)
    partial = partial_dir(final)
    fix = (f"Every rank raised this; the process group is still usable and the checkpoints saved before still "
           f"load. Fix the cause (disk space, write permission on {final.parent}) and save again: the next save "
           f"of {final.name} clears what this one left")
    run_together(ranks, lambda: start_partial(final), f"{caller}: creating {partial}", fix, only=0)
    run_together(ranks, lambda: write_files(partial), f"{caller}: writing the files of {partial}", fix)

    def finish() -> None:
        write_manifest(partial)
        publish(final)

    run_together(ranks, finish, f"{caller}: writing the manifest of {partial} and publishing it as {final.name}", fix, only=0)
    return final
