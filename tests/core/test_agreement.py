"""The rank-agreement check (``fullshard.core.checks``) on plain objects: ranks are threads, a group's
sum is a barrier that adds what every thread brought (what an all-reduce does; ``tests.core.summing_threads``)."""
import threading
from types import SimpleNamespace

import pytest

from fullshard.core.checks import (
    Fingerprint, Ranks, RanksDisagree, Row, _piece_bits, _ranks_text, check_ranks_agree, describe_model,
)
from fullshard.plan.group import AfterBackward, Strategy
from tests.core.summing_threads import FakeGroup


def run_ranks(rows_per_rank: dict, ranks_of) -> dict:
    """Run check_ranks_agree on one thread per rank; each rank's outcome (None or the error message)."""
    outcomes = dict.fromkeys(rows_per_rank)

    def rank(index: int) -> None:
        try:
            check_ranks_agree(rows_per_rank[index], ranks_of(index), "build the same model")
        except RanksDisagree as error:
            outcomes[index] = str(error)

    threads = [threading.Thread(target=rank, args=(i,)) for i in rows_per_rank]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    return outcomes


ROWS = [Row.of("module 'layers.0'", "strategy", "optim_grads_params"),
        Row.of("parameter 'layers.0.weight'", "shape", (8, 4)),
        Row.of("parameter 'layers.0.bias'", "shape", (8,))]


def one_group(size):
    group = FakeGroup(size)
    return group, (lambda rank: Ranks(group.sum, rank, size))


def test_agreeing_ranks_pass_with_one_fixed_size_sum():
    group, ranks_of = one_group(4)
    assert run_ranks({r: ROWS for r in range(4)}, ranks_of) == dict.fromkeys(range(4))
    assert group.calls == 1


@pytest.mark.parametrize("odd_rank, values", [(0, "(9,) on rank 0; (8,) on ranks 1-2"),
                                               (2, "(8,) on ranks 0-1; (9,) on rank 2")])
def test_every_rank_names_the_setting_and_every_ranks_value_whichever_rank_differs(odd_rank, values):
    rows = {r: list(ROWS) for r in range(3)}
    rows[odd_rank][2] = Row.of("parameter 'layers.0.bias'", "shape", (9,))
    group, ranks_of = one_group(3)
    outcomes = run_ranks(rows, ranks_of)
    expected = f"fully_shard: ranks disagree on shape of parameter 'layers.0.bias': {values}; build the same model"
    assert set(outcomes.values()) == {expected}, outcomes
    assert group.calls == 4  # the hash; the row counts, the rows' checksums, the differing row's text


def test_a_missing_entry_is_named_with_what_the_other_ranks_hold_there():
    group, ranks_of = one_group(2)
    outcomes = run_ranks({0: ROWS, 1: ROWS[:2]}, ranks_of)
    assert set(outcomes.values()) == {
        "fully_shard: ranks describe different models from entry 2 on: shape of parameter 'layers.0.bias' = (8,) "
        "on rank 0; nothing (its description ends after 2 entries) on rank 1; build the same model"}, outcomes


def test_entries_of_different_subjects_are_shown_whole():
    rows = {0: ROWS, 1: [ROWS[0], Row.of("parameter 'layers.0.scale'", "shape", (8, 4)), ROWS[2]]}
    outcomes = run_ranks(rows, one_group(2)[1])
    assert "from entry 1 on: shape of parameter 'layers.0.weight' = (8, 4) on rank 0; " \
           "shape of parameter 'layers.0.scale' = (8, 4) on rank 1" in outcomes[0]
    assert outcomes[0] == outcomes[1]


def grid_2x2(members=range(4)):
    """Ranks (r, s) = 2r + s summed along the shard dim, then along the replicate dim: together, over all four."""
    shard = [FakeGroup(2), FakeGroup(2)]  # per replica r: ranks 2r, 2r+1
    replicate = [FakeGroup(2), FakeGroup(2)]  # per shard s: ranks s, 2+s

    def ranks_of(rank):
        def sum_over_ranks(vector):
            return replicate[rank % 2].sum(shard[rank // 2].sum(vector))
        return Ranks(sum_over_ranks, rank, 4)
    return ranks_of


def test_a_mesh_summed_dim_by_dim_tells_every_rank():
    """HSDP 2x2 where only rank 1 differs: its replica partner (rank 3) and the other replica's ranks, whose own
    groups agree, raise too, with the same message."""
    rows = {r: ROWS for r in range(4)}
    rows[1] = [Row.of("module 'layers.0'", "strategy", "optim"), *ROWS[1:]]
    outcomes = run_ranks(rows, grid_2x2())
    assert set(outcomes.values()) == {
        "fully_shard: ranks disagree on strategy of module 'layers.0': optim_grads_params on ranks 0, 2-3; "
        "optim on rank 1; build the same model"}, outcomes


def test_ranks_outside_the_model_are_left_out_of_the_message():
    """A model on ranks 0 and 1 of a world of 4 (a pipeline stage): the other slots stay empty."""
    group = FakeGroup(2)
    rows = {0: ROWS, 1: ROWS[:1] + [Row.of("parameter 'layers.0.weight'", "shape", (4, 4))] + ROWS[2:]}
    outcomes = run_ranks(rows, lambda rank: Ranks(group.sum, rank, 4))
    assert "(8, 4) on rank 0; (4, 4) on rank 1;" in outcomes[0] and outcomes[0] == outcomes[1]


def test_a_world_of_one_exchanges_nothing():
    assert run_ranks({0: ROWS}, lambda rank: Ranks(None, 0, 1)) == {0: None}


def test_a_value_that_differs_past_what_travels_is_still_an_error():
    long = "x" * 300
    rows = {0: [Row.of("module 'm'", "mesh", long + "a")], 1: [Row.of("module 'm'", "mesh", long + "b")]}
    outcomes = run_ranks(rows, one_group(2)[1])
    assert all(o.startswith("fully_shard: ranks disagree on mesh of module 'm' = xxx")
               and "past its first 256 bytes" in o for o in outcomes.values()), outcomes


def test_rows_cut_short_are_shown_as_they_travelled():
    rows = {rank: [Row.of(f"parameter '{rank}{'p' * 300}'", "shape", (8,))] for rank in range(2)}
    outcomes = run_ranks(rows, one_group(2)[1])
    assert f"from entry 0 on: parameter '0{'p' * 244}... on rank 0; parameter '1" in outcomes[0], outcomes
    assert outcomes[0] == outcomes[1]


@pytest.mark.parametrize("size", [2, 64, 258, 259, 70000])
def test_sums_stay_exact_in_float32(size):
    bits = _piece_bits(size)
    assert size * ((1 << bits) - 1) ** 2 < 1 << 24
    assert bits == (8 if size < 259 else 4 if size < 74566 else 2)


def test_the_fingerprint_is_fixed_size_and_order_sensitive():
    a, b = Fingerprint(ROWS), Fingerprint(list(reversed(ROWS)))
    assert len(a.digest) == len(Fingerprint(ROWS * 50).digest) == 32 and a.digest != b.digest


def test_rank_lists_are_spans():
    assert _ranks_text([3]) == "rank 3" and _ranks_text([0, 2, 3, 4, 7]) == "ranks 0, 2-4, 7"


def fake_unit(name, params, strategy=Strategy.OPTIM_GRADS_PARAMS, **policy):
    group = SimpleNamespace(module_name=name, replicated=False, params=params, after_backward=AfterBackward.RESHARD,
                            unshard_in_backward=True, reduce_grads=True, all_reduce_grads=True,
                            reduce_unused_params=False)
    return SimpleNamespace(name=name, groups=[group] if params else [], strategy=strategy, reshard_after_forward=True,
                           forward_prefetch=[], backward_prefetch=[],
                           mp_policy=SimpleNamespace(**{"param_dtype": None, "reduce_dtype": None, **policy}))


def test_a_model_is_described_setting_by_setting_cause_first():
    weight = SimpleNamespace(fqn="layers.0.weight", layout=SimpleNamespace(dim=0), stored_dtype="float32",
                             compute_dtype="bfloat16", requires_grad=True)
    block = fake_unit("layers.0", [weight], reduce_dtype="float32")
    rows = describe_model([fake_unit("GPT", []), block], lambda unit: {"main_dtype": None},
                          lambda group: {"mesh": "cpu (2,)"}, lambda param: {"shape": (8, 4)})
    assert [str(row) for row in rows] == [
        "strategy of module 'layers.0' = optim_grads_params", "reshard_after_forward of module 'layers.0' = True",
        "param_dtype of module 'layers.0' = None", "reduce_dtype of module 'layers.0' = float32",
        "main_dtype of module 'layers.0' = None",
        "forward prefetch of module 'layers.0' = []", "backward prefetch of module 'layers.0' = []",
        "mesh of module 'layers.0' = cpu (2,)",
        "reshard_after_backward of module 'layers.0' = reshard", "unshard_in_backward of module 'layers.0' = True",
        "requires_gradient_sync of module 'layers.0' = True", "requires_all_reduce of module 'layers.0' = True",
        "reduce_scatter_unused_params of module 'layers.0' = False",
        "shard dim of parameter 'layers.0.weight' = 0", "dtype of parameter 'layers.0.weight' = float32",
        "compute dtype of parameter 'layers.0.weight' = bfloat16",
        "requires_grad of parameter 'layers.0.weight' = True",
        "shape of parameter 'layers.0.weight' = (8, 4)",
    ]
