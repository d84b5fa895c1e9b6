"""Issue 3 accounting: per-rank bytes held and moved equal the ZeRO formulas, at N = 2 and N = 4."""
import pytest

from tests.harness import assert_scenario, run_suite
from tests.suite_accounting import suite


@pytest.fixture(scope="module", params=[2, 4])
def results(request):
    return run_suite("tests.suite_accounting:suite", world_size=request.param, timeout=600)


@pytest.mark.parametrize("name", list(suite()))
def test_scenario(results, name):
    assert_scenario(results, name)
