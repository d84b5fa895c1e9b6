"""Issue 3 accounting: per-rank bytes held and moved equal the ZeRO formulas, at N = 2 and N = 4."""
from tests.harness import suite_tests

results, test_scenario = suite_tests("tests.suite_accounting:suite", world_sizes=(2, 4))
