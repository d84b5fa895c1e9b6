"""Usage patterns of client libraries (tests/suite_clients.py) on 2 gloo ranks."""
from tests.harness import suite_tests

results, test_scenario = suite_tests("tests.suite_clients:suite", world_sizes=(2,))
