"""The rank-agreement check (``fullshard.core.agreement``) on plain objects: ranks are threads, a group's
sum is a barrier that adds what every thread brought (what an all-reduce does)."""
import threading

import pytest

from fullshard.core.agreement import Fingerprint, RanksDisagree, _piece_bits, check_ranks_agree


class FakeGroup:
    """``size`` threads sum float lists elementwise, as one all-reduce per call; counts the calls."""

    def __init__(self, size: int) -> None:
        self.size, self.calls = size, 0
        self._barrier = threading.Barrier(size)
        self._lock = threading.Lock()
        self._vectors: list = []

    def sum(self, vector: list[float]) -> list[float]:
        with self._lock:
            self._vectors.append(vector)
        self._barrier.wait()
        assert len({len(v) for v in self._vectors}) == 1, "ranks brought vectors of different sizes"
        total = [sum(values) for values in zip(*self._vectors)]
        if self._barrier.wait() == 0:
            self._vectors.clear()
            self.calls += 1
        self._barrier.wait()
        return total


def run_ranks(rows_per_rank: list[list], groups_of) -> list:
    """Run check_ranks_agree on one thread per rank; each rank's outcome (None or the error message)."""
    outcomes = [None] * len(rows_per_rank)

    def rank(index: int) -> None:
        try:
            check_ranks_agree(rows_per_rank[index], groups_of(index), "build the same model")
        except RanksDisagree as error:
            outcomes[index] = str(error)

    threads = [threading.Thread(target=rank, args=(i,)) for i in range(len(rows_per_rank))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    return outcomes


ROWS = [("layers.0.weight", (8, 4), 0, "float32", True), ("layers.0.bias", (8,), 0, "float32", True)]


def one_group(size):
    group = FakeGroup(size)
    return group, (lambda rank: [("shard", size, group.sum)])


def test_agreeing_ranks_pass_with_one_fixed_size_sum():
    group, groups_of = one_group(4)
    assert run_ranks([ROWS] * 4, groups_of) == [None] * 4
    assert group.calls == 1


@pytest.mark.parametrize("odd_rank", [0, 2])
def test_every_rank_names_the_first_differing_row_whichever_rank_differs(odd_rank):
    rows = [list(ROWS) for _ in range(3)]
    rows[odd_rank][1] = ("layers.0.bias", (9,), 0, "float32", True)
    group, groups_of = one_group(3)
    outcomes = run_ranks(rows, groups_of)
    assert all(o is not None and "shard group" in o and "entry 1" in o and "layers.0.bias" in o for o in outcomes)
    assert group.calls == 3  # the hash, the row count, the rows


def test_a_different_number_of_rows_is_said_as_such():
    group, groups_of = one_group(2)
    outcomes = run_ranks([ROWS, ROWS[:1]], groups_of)
    assert "different numbers of entries (here 2)" in outcomes[0] and "(here 1)" in outcomes[1]


def test_replicas_are_compared_too():
    """HSDP 2x2: ranks (r, s). Replica 1 wrapped another model: the shard groups agree within themselves,
    the replicate groups do not, and every rank raises."""
    shard = [FakeGroup(2), FakeGroup(2)]  # per replica r: ranks 2r, 2r+1
    replicate = [FakeGroup(2), FakeGroup(2)]  # per shard s: ranks s, 2+s
    other = [("layers.0.weight", (8, 5), 0, "float32", True), ROWS[1]]
    rows = [ROWS, ROWS, other, other]
    outcomes = run_ranks(rows, lambda r: [("shard", 2, shard[r // 2].sum), ("replicate", 2, replicate[r % 2].sum)])
    assert all(o is not None and "replicate group" in o and "entry 0" in o for o in outcomes), outcomes


def test_groups_of_one_exchange_nothing():
    assert run_ranks([ROWS], lambda rank: [("shard", 1, None)]) == [None]


@pytest.mark.parametrize("size", [2, 64, 258, 259, 70000])
def test_sums_stay_exact_in_float32(size):
    bits = _piece_bits(size)
    assert size * ((1 << bits) - 1) ** 2 < 1 << 24
    assert bits == (8 if size < 259 else 4 if size < 74566 else 2)


def test_the_fingerprint_is_fixed_size_and_order_sensitive():
    a, b = Fingerprint(ROWS), Fingerprint(list(reversed(ROWS)))
    assert len(a.digest) == len(Fingerprint(ROWS * 50).digest) == 32 and a.digest != b.digest
