"""Tensor parallelism composed with fully_shard (tests/suite_tp.py) on 4 gloo ranks, (dp=2, tp=2)."""
from tests.harness import suite_tests

results, test_scenario = suite_tests("tests.suite_tp:suite", world_sizes=(4,))
