"""Issue 5 meta-device initialization, at N = 2 and N = 4 (N = 1 is the unsharded reference)."""
from tests.harness import suite_tests

results, test_scenario = suite_tests("tests.suite_init:suite", world_sizes=(2, 4))
