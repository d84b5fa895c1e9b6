"""Issue 2 regression tests for the seed's bug class, on 2 gloo ranks with the sanitizer on."""
import pytest

from tests.harness import assert_scenario, run_suite
from tests.suite_ownership import suite


@pytest.fixture(scope="module")
def results():
    return run_suite("tests.suite_ownership:suite", world_size=2, timeout=600, env={"FULLSHARD_CHECK_OWNERSHIP": "1"})


@pytest.mark.parametrize("name", list(suite()))
def test_scenario(results, name):
    assert_scenario(results, name)
