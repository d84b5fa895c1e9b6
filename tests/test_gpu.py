"""GPU-only paths, run wherever CUDA is present (skipped on a CPU-only machine): one rank, so no
collective is needed whatever the backend, with pinned-memory CPU offload."""
import pytest
import torch

from tests.harness import assert_scenario, run_suite

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_pinned_offload_accumulates_after_the_copy_lands():
    results = run_suite("tests.suite_runtime:suite", world_size=1, timeout=600)
    (device,) = assert_scenario(results, "offloaded_grads_accumulate_after_the_copy_lands")
    assert device.startswith("cuda")
