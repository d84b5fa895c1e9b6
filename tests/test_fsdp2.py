"""FSDP2 behaviours (issue 16, tests/suite_fsdp2.py) on 2 gloo ranks."""
from tests.harness import suite_tests

results, test_scenario = suite_tests("tests.suite_fsdp2:suite", world_sizes=(2,))
