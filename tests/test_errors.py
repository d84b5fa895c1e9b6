"""Issue 7: clear errors for bad input, nothing half-applied; 2 gloo ranks."""
from tests.harness import suite_tests

results, test_scenario = suite_tests("tests.suite_errors:suite", world_sizes=(2,))
