"""fullshard.mindspore: the gradient every consumer sees, against one process (``tests/ms_suite_gradients.py``):
every case x strategy x fusion on 2 msrun workers (a flat mesh) and on 4 (HSDP, 2 x 2); every rank issues the
reductions the model says it must, and the same ones as every other rank."""
import pytest

pytest.importorskip("mindspore")

from tests.harness import assert_scenario  # noqa: E402
from tests.ms_harness import run_ms_suite  # noqa: E402
from tests.ms_suite_gradients import hsdp_suite, suite  # noqa: E402

LAUNCHES = {"tests.ms_suite_gradients:suite": (2, list(suite())),
            "tests.ms_suite_gradients:hsdp_suite": (4, list(hsdp_suite()))}
NAMES = [name for _, names in LAUNCHES.values() for name in names]


@pytest.fixture(scope="module")
def results():
    merged = {}
    for target, (world_size, _) in LAUNCHES.items():
        merged.update(run_ms_suite(target, world_size=world_size, timeout=900, env={"FULLSHARD_CHECK_OWNERSHIP": "1"}))
    return merged


@pytest.mark.parametrize("name", NAMES)
def test_scenario(results, name):
    per_rank = assert_scenario(results, name)
    counts = [data["reductions"] for data in per_rank]
    assert all(c == counts[0] for c in counts), f"ranks issued different reductions: {counts}"
