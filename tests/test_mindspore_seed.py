"""The seed's bug re-created inside fullshard.mindspore's bprop is stopped by the sanitizer, naming the
parameter (a launch of its own: a raise inside a MindSpore bprop may crash a later one)."""
import pytest

pytest.importorskip("mindspore")

from tests.harness import suite_tests  # noqa: E402
from tests.ms_harness import run_ms_suite  # noqa: E402

results, test_scenario = suite_tests("tests.ms_suite_seed:suite", world_sizes=(2,), runner=run_ms_suite,
                                     env={"FULLSHARD_CHECK_OWNERSHIP": "1"})
