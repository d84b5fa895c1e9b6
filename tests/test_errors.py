"""Issue 7: clear errors for bad input, nothing half-applied; 2 gloo ranks."""
import pytest

from tests.harness import assert_scenario, run_suite
from tests.suite_errors import suite


@pytest.fixture(scope="module")
def results():
    return run_suite("tests.suite_errors:suite", world_size=2, timeout=600)


@pytest.mark.parametrize("name", list(suite()))
def test_scenario(results, name):
    assert_scenario(results, name)
