"""A 2-rank training step in which rank 1 dies mid-step (run by tests/torch/test_dead_rank.py)."""
import datetime
import os
import sys

import torch
import torch.distributed as dist

from tests.torch.parity import build_gpt, gpt_batch, gpt_loss, mesh_1d, shard_blocks_then_root


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=int(os.environ["FAULT_TIMEOUT_S"])))
    rank = dist.get_rank()
    model = shard_blocks_then_root(build_gpt(), mesh=mesh_1d())
    for step in range(3):
        loss = gpt_loss(model, tuple(t.chunk(2)[rank] for t in gpt_batch(step, 4)))
        if step == 1 and rank == 1:
            os._exit(17)  # killed between forward and backward
        loss.backward()
    print("survived", file=sys.stderr)


if __name__ == "__main__":
    main()
