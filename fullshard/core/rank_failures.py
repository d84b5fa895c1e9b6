"""Every rank learns that a part of a collective step failed, on which rank and why: sums only, both runtimes.

Some steps mix collectives with parts that one rank does alone (a checkpoint
save: rank 0 creates the directory, every rank writes its files, rank 0
writes the manifest and publishes). If a rank simply raised, the others
would wait in the step's next collective until the process group's timeout,
and the group would then be dead. Instead every rank reports after each
part, failed or not, in one all-reduce, and all of them raise the same
:class:`RanksFailed` naming the failed ranks and their errors. The group
stays in step, so a caller that catches the error can go on using it.

Only float32 sums travel, as in :mod:`fullshard.core.agreement`, so this runs
on every backend (MindSpore's CPU one sums float32 only). A first round sums
one flag per rank. Only when a flag is set does a second round carry each
failed rank's message: its UTF-8 bytes as floats in a slot that rank alone
fills, so the sums are the bytes, exactly.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from fullshard.core.agreement import SumOverGroup

_CAUSE_BYTES = 480  # of each failed rank's message; a longer one is cut short
_NAMED = 4  # failed ranks whose messages are carried; the rest are counted


class RanksFailed(RuntimeError):
    """A part of a collective step failed on some ranks; every rank of the group raises it, naming them."""

    def __init__(self, message: str, failures: dict[int, str]) -> None:
        super().__init__(message)
        self.failures = failures  # rank -> "ErrorType: message" (the first few failed ranks)


def _cause(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


def _encoded(text: str) -> list[float]:
    data = text.encode("utf-8")[:_CAUSE_BYTES]
    return [float(b) for b in data] + [0.0] * (_CAUSE_BYTES - len(data))


def _decoded(values: list[float]) -> str:
    # a message cut short may end inside a character: drop that partial character
    return bytes(round(v) for v in values).rstrip(b"\0").decode("utf-8", "ignore")


@dataclass(frozen=True)
class Ranks:
    """This process's rank in a group, the group's size, and the group's float32 sum (one all-reduce)."""

    rank: int
    size: int
    sum_over_group: SumOverGroup

    def run(self, action: Callable[[], object], what: str, fix: str, only: Optional[int] = None) -> None:
        """``action()`` here (only on rank ``only``, if given), then :meth:`share` how it went."""
        error = None
        if only is None or only == self.rank:
            try:
                action()
            except Exception as caught:  # every rank must learn of it, or the others would wait for this one
                error = caught
        self.share(error, what, fix)

    def share(self, error: Optional[Exception], what: str, fix: str) -> None:
        """Every rank calls it with its own ``error`` (None: this rank's part went well). If any rank failed,
        every rank raises :class:`RanksFailed`: "``what`` failed on rank R: <its error>. ``fix``".

        A group of one has no one to tell: its error is raised as it is.
        """
        if self.size == 1:
            if error is not None:
                raise error
            return
        flags = self.sum_over_group([1.0 if rank == self.rank and error is not None else 0.0
                                     for rank in range(self.size)])
        failed = [rank for rank, flag in enumerate(flags) if flag > 0.5]
        if not failed:
            return
        named = failed[:_NAMED]
        slots = [_encoded(_cause(error)) if rank == self.rank else [0.0] * _CAUSE_BYTES for rank in named]
        summed = self.sum_over_group([value for slot in slots for value in slot])
        causes = {rank: _decoded(summed[i * _CAUSE_BYTES:(i + 1) * _CAUSE_BYTES]) for i, rank in enumerate(named)}
        if len(failed) == 1:
            where = f"rank {failed[0]}: {causes[failed[0]]}"
        else:
            more = f"; and {len(failed) - len(named)} more ranks" if len(failed) > len(named) else ""
            where = f"{len(failed)} ranks ({'; '.join(f'rank {r}: {c}' for r, c in causes.items())}{more})"
        raise RanksFailed(f"{what} failed on {where}. {fix}", causes) from error
