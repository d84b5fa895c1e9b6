"""Full parameters out of a sharded cell (sharded checkpoints build on this)."""
from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn

from fullshard.mindspore.autograd import no_grad
from fullshard.mindspore.collectives import gather_full
from fullshard.mindspore.param import sharded_param_of


def _numpy(tensor: Tensor) -> np.ndarray:
    # numpy has no bfloat16: those come out as float32 (every bf16 value is one)
    return (tensor.astype(ms.float32) if tensor.dtype == ms.bfloat16 else tensor).asnumpy()


def full_state_dict(cell: nn.Cell) -> dict[str, np.ndarray]:
    """Every parameter of ``cell`` whole, on every rank, under the names from before sharding.

    The names are the paths ``parameters_and_names()`` gives (tied parameters once). Sharded
    parameters are gathered from their shards (a collective: call it on every rank, in the same
    order); the others are copied as they are. bfloat16 values come back as float32 arrays.
    """
    full = {}
    with no_grad():
        for name, param in cell.parameters_and_names():
            sharded = sharded_param_of(param)
            if sharded is None:
                full[name] = _numpy(param)
                continue
            group = sharded.group
            full[name] = _numpy(gather_full(sharded, group.comm, group.plan.collectives.gather, group.plan.backend))
    return full
