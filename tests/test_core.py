"""Issue 2 parity scenarios: fully_shard on 2 gloo ranks against a single-process reference."""
from tests.harness import assert_scenario, suite_tests

results, test_scenario = suite_tests("tests.suite_core:suite", world_sizes=(2,))


def test_losses_fall(results):
    """The default run really trains: the loss goes down."""
    (data, _) = assert_scenario(results, "default_gpt")
    assert data["losses"][-1] < data["losses"][0]
