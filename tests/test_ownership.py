"""Issue 2 regression tests for the seed's bug class, on 2 gloo ranks with the sanitizer on."""
from tests.harness import suite_tests

results, test_scenario = suite_tests("tests.suite_ownership:suite", world_sizes=(2,), env={"FULLSHARD_CHECK_OWNERSHIP": "1"})
