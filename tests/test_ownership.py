"""Regression tests for the seed's bug class, on 2 gloo ranks with the sanitizer on: the seed's configuration,
and an aliasing "copy" re-introduced at every site that makes an owned buffer (the two sites only more ranks
reach: ``test_ownership4.py``)."""
from tests.harness import suite_tests

results, test_scenario = suite_tests("tests.suite_ownership:suite", world_sizes=(2,), env={"FULLSHARD_CHECK_OWNERSHIP": "1"})
