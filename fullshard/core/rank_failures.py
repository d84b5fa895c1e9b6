"""Every rank learns that a part of a collective step failed, on which rank and why: sums only, both runtimes.

Some steps mix collectives with parts that one rank does alone (a checkpoint
save: rank 0 creates the directory, every rank writes its files, rank 0
writes the manifest and publishes). If a rank simply raised, the others
would wait in the step's next collective until the process group's timeout,
and the group would then be dead. Instead every rank reports after each
part, failed or not, in one sum, and all of them raise the same
:class:`RanksFailed` naming the failed ranks and their errors. The group
stays in step, so a caller that catches the error can go on using it.

The ranks and their float32 sums are :class:`fullshard.core.agreement.Ranks`
(the same on every backend: MindSpore's CPU one sums float32 only). A first
sum carries one flag per rank; only when one is set does a second carry every
failed rank's message (:func:`fullshard.core.agreement.gather_texts`).
"""
from __future__ import annotations

from typing import Callable, Optional

from fullshard.core.agreement import Ranks, gather_texts

CAUSE_BYTES = 480  # of each failed rank's message; a longer one is cut short


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
