"""Issue 3 HSDP: 4 gloo ranks on a 2x2 (replicate, shard) mesh."""
import pytest

from tests.harness import assert_scenario, run_suite
from tests.suite_hsdp import suite


@pytest.fixture(scope="module")
def results():
    return run_suite("tests.suite_hsdp:suite", world_size=4, timeout=600)


@pytest.mark.parametrize("name", list(suite()))
def test_scenario(results, name):
    assert_scenario(results, name)
