"""Issue 5 meta-device initialization, at N = 2 and N = 4 (N = 1 is the unsharded reference)."""
import pytest

from tests.harness import assert_scenario, run_suite
from tests.suite_init import suite


@pytest.fixture(scope="module", params=[2, 4])
def results(request):
    return run_suite("tests.suite_init:suite", world_size=request.param, timeout=600)


@pytest.mark.parametrize("name", list(suite()))
def test_scenario(results, name):
    assert_scenario(results, name)
