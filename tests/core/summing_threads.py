"""Ranks as threads for the tests of code that only sums across ranks (``fullshard.core.checks.Ranks``): a group's
sum is a barrier that adds what every thread brought, as one all-reduce does."""
import threading


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
