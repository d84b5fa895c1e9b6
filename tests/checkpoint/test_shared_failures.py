"""Sharing a failure (``fullshard.checkpoint.publish``) on plain objects: ranks are threads, a group's sum is
a barrier that adds what every thread brought (``tests.core.summing_threads.FakeGroup``). Real ranks:
tests/checkpoint/test_torch.py and tests/checkpoint/test_mindspore.py fail saves on one rank."""
import errno
import threading

import pytest

from fullshard.core.checks import Ranks, alone
from fullshard.checkpoint.publish import CAUSE_BYTES, RanksFailed, run_together, share
from tests.core.summing_threads import FakeGroup

FIX = "Fix it and try again"


def in_threads(size: int, body) -> tuple[list, FakeGroup]:
    """``body(ranks)`` on one thread per rank; each rank's outcome (None or what it raised) and the group,
    which counted its sums."""
    group, outcomes = FakeGroup(size), [None] * size

    def rank(index: int) -> None:
        try:
            body(Ranks(group.sum, index, size))
        except Exception as error:
            outcomes[index] = error

    threads = [threading.Thread(target=rank, args=(i,)) for i in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    return outcomes, group


def run_ranks(size: int, errors: dict) -> tuple[list, FakeGroup]:
    """Every rank shares its error from ``errors`` (rank -> exception)."""
    return in_threads(size, lambda ranks: share(ranks, errors.get(ranks.slot), "saving x", FIX))


def test_no_failure_costs_one_sum_of_one_flag_per_rank():
    outcomes, group = run_ranks(4, {})
    assert outcomes == [None] * 4 and group.calls == 1


def test_one_rank_fails_and_every_rank_raises_naming_it_and_its_error():
    disk_full = OSError(errno.ENOSPC, "No space left on device")
    outcomes, group = run_ranks(4, {2: disk_full})
    expected = f"saving x failed on rank 2: OSError: [Errno 28] No space left on device. {FIX}"
    assert all(isinstance(o, RanksFailed) and str(o) == expected for o in outcomes), outcomes
    assert all(o.failures == {2: "OSError: [Errno 28] No space left on device"} for o in outcomes)
    assert outcomes[2].__cause__ is disk_full and outcomes[0].__cause__ is None
    assert group.calls == 2  # the flags, then the failed ranks' messages


def test_several_failures_are_each_named():
    errors = {rank: RuntimeError(f"broke on {rank}") for rank in (1, 3, 4)}
    outcomes, _ = run_ranks(6, errors)
    message = str(outcomes[0])
    assert message == ("saving x failed on 3 ranks (rank 1: RuntimeError: broke on 1; rank 3: RuntimeError: broke on 3; "
                       f"rank 4: RuntimeError: broke on 4). {FIX}")
    assert all(str(o) == message for o in outcomes)


def test_a_long_message_is_cut_short_on_a_whole_character():
    outcomes, _ = run_ranks(2, {1: ValueError("é" * CAUSE_BYTES)})
    cause = outcomes[0].failures[1]
    assert cause == ("ValueError: " + "é" * CAUSE_BYTES).encode()[:CAUSE_BYTES].decode("utf-8", "ignore") + "..."
    assert cause.endswith("é...") and str(outcomes[1]) == str(outcomes[0])


def test_alone_the_error_itself_is_raised():
    error = OSError(errno.EROFS, "Read-only file system")
    with pytest.raises(OSError) as raised:
        share(alone(), error, "saving x", FIX)
    assert raised.value is error


def test_run_runs_the_action_on_the_named_rank_only():
    ran = []

    def action(rank: int) -> None:
        ran.append(rank)
        raise KeyError("missing")

    outcomes, _ = in_threads(2, lambda ranks: run_together(ranks, lambda: action(ranks.slot), "publishing", FIX, only=0))
    assert ran == [0] and [str(o) for o in outcomes] == [f"publishing failed on rank 0: KeyError: 'missing'. {FIX}"] * 2
