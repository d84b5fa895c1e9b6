"""fullshard.mindspore against a single-process reference on 2 msrun workers (one launch, every scenario)."""
import pytest

pytest.importorskip("mindspore")

from tests.harness import suite_tests  # noqa: E402
from tests.ms_harness import run_ms_suite  # noqa: E402

results, test_scenario = suite_tests("tests.ms_suite_parity:suite", world_sizes=(2,), runner=run_ms_suite)
