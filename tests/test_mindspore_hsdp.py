"""fullshard.mindspore HSDP on a (2 replicate, 2 shard) mesh, 4 msrun workers (one launch)."""
import pytest

pytest.importorskip("mindspore")

from tests.harness import suite_tests  # noqa: E402
from tests.ms_harness import run_ms_suite  # noqa: E402

results, test_scenario = suite_tests("tests.ms_suite_hsdp:suite", world_sizes=(4,), runner=run_ms_suite,
                                     env={"FULLSHARD_CHECK_OWNERSHIP": "1"})
