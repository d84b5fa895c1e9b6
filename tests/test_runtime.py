"""Issue 12 scenarios (tests/suite_runtime.py) on 2 gloo ranks."""
from tests.harness import suite_tests

results, test_scenario = suite_tests("tests.suite_runtime:suite", world_sizes=(2,))
