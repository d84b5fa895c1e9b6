"""The pairwise exchange fullshard uses on gloo, against torch's collectives, at N = 2 and N = 4."""
from tests.harness import suite_tests

results, test_scenario = suite_tests("tests.suite_exchange:suite", world_sizes=(2, 4))
