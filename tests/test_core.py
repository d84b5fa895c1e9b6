"""Issue 2 parity scenarios: fully_shard on 2 gloo ranks against a single-process reference."""
import pytest

from tests.harness import assert_scenario, run_suite
from tests.suite_core import suite

SCENARIOS = list(suite())


@pytest.fixture(scope="module")
def results():
    return run_suite("tests.suite_core:suite", world_size=2, timeout=600)


@pytest.mark.parametrize("name", SCENARIOS)
def test_scenario(results, name):
    assert_scenario(results, name)


def test_losses_fall(results):
    """The default run really trains: the loss goes down."""
    (data, _) = assert_scenario(results, "default_gpt")
    assert data["losses"][-1] < data["losses"][0]
