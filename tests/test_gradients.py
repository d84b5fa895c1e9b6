"""The gradient matrix (torch): every case x strategy x fusion against a single-process reference, step by step,
with the reductions counted against the plan; all 2-rank scenarios in one spawn (a flat mesh), all 4-rank ones
in another (a 2x2 HSDP mesh). The scenarios and what each checks: tests/suite_gradients.py."""
import pytest

from tests.harness import assert_scenario, run_suite
from tests.suite_gradients import suite, suite_hsdp

TIMEOUT_S = 600  # per spawn; each collective also times out (tests/harness.py)


@pytest.fixture(scope="module")
def flat_results():
    return run_suite("tests.suite_gradients:suite", world_size=2, timeout=TIMEOUT_S)


@pytest.fixture(scope="module")
def hsdp_results():
    return run_suite("tests.suite_gradients:suite_hsdp", world_size=4, timeout=TIMEOUT_S)


@pytest.mark.parametrize("name", list(suite()))
def test_flat_2ranks(flat_results, name):
    assert_scenario(flat_results, name)


@pytest.mark.parametrize("name", list(suite_hsdp()))
def test_hsdp_2x2(hsdp_results, name):
    assert_scenario(hsdp_results, name)


def test_fusion_changes_the_reduction_count(flat_results):
    """The same case reduces once per parameter unfused, once per bucket fused: fewer collectives."""
    names = set(suite())
    for name in names:
        if name.endswith("-fused") and name.replace("-fused", "-unfused") in names:
            fused = assert_scenario(flat_results, name)[0]["reductions_per_step"]
            unfused = assert_scenario(flat_results, name.replace("-fused", "-unfused"))[0]["reductions_per_step"]
            assert all(f < u for f, u in zip(fused, unfused)), (name, fused, unfused)
