"""Issue 3 HSDP and partial resharding: 4 gloo ranks (a 2x2 (replicate, shard) mesh)."""
from tests.harness import suite_tests

results, test_scenario = suite_tests("tests.suite_hsdp:suite", world_sizes=(4,))
