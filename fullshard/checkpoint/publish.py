"""Publishing a checkpoint: a directory that is always found complete, and a save that fails on every rank at once.

A checkpoint ``<root>/step_<N>`` is written as ``step_<N>.partial``; once
every rank has finished, the manifest (:mod:`fullshard.checkpoint.manifest`)
is written into it and :func:`publish` renames it into place. A directory
cannot be renamed over a non-empty one, so publishing over an older
checkpoint takes steps, and at every instant one of these holds:

- ``step_<N>`` is a complete checkpoint (the old one or the new one), or
- ``step_<N>`` is absent and a complete one is beside it: the new one as a
  ``.partial`` whose manifest verifies, or the old one as ``.replaced``.

:func:`resolve` (used by every loader, ``export`` and ``--resume``) and
:func:`latest_step` apply that rule, so a crash anywhere in a save leaves a
checkpoint that loads; :func:`resolve` warns when it takes the one beside.
A save cut short before its manifest leaves a ``.partial`` that is never
taken and that the next save of that step removes.

:func:`save_together` runs the protocol across ranks. A save mixes parts one
rank does alone (rank 0 creates the ``.partial``, writes the manifest and
publishes) with the part every rank does (its own files). If a rank simply
raised, the others would wait in the save's next collective until the
process group's timeout, and the group would then be dead. Instead every
rank reports after each part, failed or not (:func:`share`), and all of them
raise the same :class:`RanksFailed` naming the failed ranks and their
errors; the group stays in step, so a caller that catches the error can go
on using it. The ranks and their float32 sums are
:class:`fullshard.core.checks.Ranks` (the same on every backend:
MindSpore's CPU one sums float32 only). A first sum carries one flag per
rank; only when one is set does a second carry every failed rank's message
(:func:`fullshard.core.checks.gather_texts`).
"""
from __future__ import annotations

import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Callable, Optional, Union

from fullshard.checkpoint import manifest
from fullshard.checkpoint.files import fsync_dir
from fullshard.checkpoint.untrusted import CheckpointError
from fullshard.core.checks import Ranks, gather_texts

_STEP = re.compile(r"^step_(\d+)(\.partial|\.replaced)?$")
CAUSE_BYTES = 480  # of each failed rank's message that travels to the others; a longer one is cut short


class RecoveredCheckpointWarning(UserWarning):
    """A checkpoint was missing at its path and the complete copy an interrupted save left beside it was used."""


# ---------------------------------------------------------------------- the directories
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


# ---------------------------------------------------------------------- every rank learns how a part went
class RanksFailed(RuntimeError):
    """A part of a collective step failed on some ranks; every rank of the group raises it, naming them."""

    def __init__(self, message: str, failures: dict[int, str]) -> None:
        super().__init__(message)
        self.failures = failures  # rank -> "ErrorType: message"


def _cause(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


def run_together(ranks: Ranks, action: Callable[[], object], what: str, fix: str, only: Optional[int] = None) -> None:
    """``action()`` here (only on rank ``only``, if given), then :func:`share` how it went."""
    error = None
    if only is None or only == ranks.slot:
        try:
            action()
        except Exception as caught:  # every rank must learn of it, or the others would wait for this one
            error = caught
    share(ranks, error, what, fix)


def share(ranks: Ranks, error: Optional[Exception], what: str, fix: str) -> None:
    """Every rank calls it with its own ``error`` (None: this rank's part went well). If any rank failed, every
    rank raises :class:`RanksFailed`: "``what`` failed on rank R: <its error>. ``fix``".

    Alone (no process group) there is no one to tell: the error is raised as it is.
    """
    if ranks.slots == 1:
        if error is not None:
            raise error
        return
    flags = ranks.sum([1.0 if slot == ranks.slot and error is not None else 0.0 for slot in range(ranks.slots)])
    failed = [slot for slot, flag in enumerate(flags) if flag > 0.5]
    if not failed:
        return
    texts = gather_texts(ranks, _cause(error) if error is not None else "", CAUSE_BYTES)
    causes = {slot: texts[slot] for slot in failed}
    if len(failed) == 1:
        where = f"rank {failed[0]}: {causes[failed[0]]}"
    else:
        where = f"{len(failed)} ranks ({'; '.join(f'rank {r}: {c}' for r, c in causes.items())})"
    raise RanksFailed(f"{what} failed on {where}. {fix}", causes) from error


# ---------------------------------------------------------------------- publishing
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
    :class:`RanksFailed` on every rank at once, naming that rank and its
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
