"""GPU-only paths, run wherever CUDA is present (skipped on a CPU-only machine): one rank, so no collective is
needed whatever the backend, with pinned-memory CPU offload."""
import pytest
import torch

from tests.conftest import Launch, scenario
from tests.torch.test_runtime import offloaded_grads_accumulate_after_the_copy_lands

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
LAUNCH = Launch(world_sizes=(1,))


@scenario
def pinned_offload_accumulates_after_the_copy_lands():
    """The runtime's offload scenario (``tests/torch/test_runtime.py``), on the GPU: the reduced gradient is
    copied to pinned host memory without blocking, and the sum into the last one waits for the copy."""
    device = offloaded_grads_accumulate_after_the_copy_lands()
    assert device.startswith("cuda"), device
    return device
