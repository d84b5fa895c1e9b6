"""Issue 3 strategies: parity for every strategy x precision x accumulation, on 2 gloo ranks."""
from tests.harness import suite_tests

results, test_scenario = suite_tests("tests.suite_strategies:suite", world_sizes=(2,))
