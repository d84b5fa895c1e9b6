"""Do all ranks hold the same model? A fixed-size check both runtimes run alike, with sums only.

Each rank describes what it wrapped as rows (one per parameter: name, global
shape, shard dim, dtypes, trainability, ...) and hashes them (SHA-256). Every
group of the mesh then sums, per piece of the hash, the piece and its square.
All ranks of a group hold the same piece ``p`` exactly when the sums are
``n * p`` and ``n * p * p``: the sum of ``(x - p) ** 2`` over the ranks is then
zero. Every rank sees a disagreement, whichever rank differs.

Nothing is unpickled and nothing but a float sum travels, so the check runs on
every backend and group (MindSpore's CPU backend sums float32 only, and
gathers on the world group only). Pieces are chosen small enough that every
sum is an integer a float32 carries exactly (below 2**24).

Only when the hashes differ does a second round find the first row that
differs (each row's CRC32 in the same pieces), so the error names a parameter.
"""
from __future__ import annotations

import hashlib
import zlib
from typing import Callable, Iterable, Sequence

# A group's sum of float32 values: what each runtime supplies for one group (one all-reduce, SUM).
SumOverGroup = Callable[[list[float]], list[float]]
_EXACT = 1 << 24  # integers up to this are exact in float32


class RanksDisagree(RuntimeError):
    """Ranks of a group wrapped different models (or planned them differently)."""


def _piece_bits(group_size: int) -> int:
    """The widest pieces (8, 4, 2 or 1 bits) whose squares summed over the group stay exact in float32."""
    for bits in (8, 4, 2, 1):
        if group_size * ((1 << bits) - 1) ** 2 < _EXACT:
            return bits
    raise ValueError(f"a group of {group_size} ranks is too large to compare in float32 sums")


def _pieces(data: bytes, bits: int) -> list[int]:
    per_byte, mask = 8 // bits, (1 << bits) - 1
    return [(byte >> (bits * i)) & mask for byte in data for i in range(per_byte)]


def _vector(pieces: Sequence[int]) -> list[float]:
    return [float(p) for p in pieces] + [float(p * p) for p in pieces]


def _same(summed: Sequence[float], pieces: Sequence[int], group_size: int) -> list[bool]:
    """Per piece: does every rank hold this rank's value?"""
    count = len(pieces)
    return [summed[i] == group_size * p and summed[count + i] == group_size * p * p for i, p in enumerate(pieces)]


class Fingerprint:
    """What one rank wrapped, as rows, and the sums that compare it with a group's other ranks."""

    def __init__(self, rows: Iterable[object]) -> None:
        self.rows = [repr(row) for row in rows]
        header = f"{len(self.rows)} rows\n".encode()
        self.digest = hashlib.sha256(header + "\n".join(self.rows).encode()).digest()

    def agrees(self, sum_over_group: SumOverGroup, group_size: int) -> bool:
        pieces = _pieces(self.digest, _piece_bits(group_size))
        return all(_same(sum_over_group(_vector(pieces)), pieces, group_size))

    def difference(self, sum_over_group: SumOverGroup, group_size: int) -> str:
        """What differs: the number of rows, or the first row some rank holds differently. Every rank of the
        group must call it (it sums twice), and every rank gets the same answer about its own rows."""
        count = [len(self.rows)]
        if not all(_same(sum_over_group(_vector(count)), count, group_size)):
            return f"they hold different numbers of entries (here {len(self.rows)})"
        bits = _piece_bits(group_size)
        per_row = 32 // bits
        pieces = [p for row in self.rows for p in _pieces(zlib.crc32(row.encode()).to_bytes(4, "little"), bits)]
        same = _same(sum_over_group(_vector(pieces)), pieces, group_size)
        for index, row in enumerate(self.rows):
            if not all(same[index * per_row:(index + 1) * per_row]):
                return f"first difference at entry {index}: {row} here"
        return "their descriptions hash differently, though no single entry's checksum does"


def check_ranks_agree(rows: Iterable[object], groups: Sequence[tuple[str, int, SumOverGroup]], hint: str) -> None:
    """Raise :class:`RanksDisagree` on every rank of the first group whose ranks hold different ``rows``.

    ``groups``: (name, size, sum) of every group of the mesh (a group of one is skipped), the same list
    on every rank. ``hint`` says what the ranks must do alike.
    """
    fingerprint = Fingerprint(rows)
    for name, size, sum_over_group in groups:
        if size > 1 and not fingerprint.agrees(sum_over_group, size):
            raise RanksDisagree(f"fully_shard: the ranks of the {name} group wrapped different models "
                                f"({fingerprint.difference(sum_over_group, size)}); {hint}")
