"""One HSDP + tensor parallel check, (2, 2, 2) on 8 gloo ranks (kept tiny: 8 processes share the CPUs)."""
from tests.harness import suite_tests

results, test_scenario = suite_tests("tests.suite_tp:suite8", world_sizes=(8,))
