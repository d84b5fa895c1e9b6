"""A save interrupted by a killed worker (tests/checkpoint/test_mindspore.py runs it on 2 msrun workers).

Both ranks save a complete checkpoint, then save again to the same path; rank
1 dies (SIGKILL) half way through writing its file. Rank 0 writes ``expected.npz``
(the full parameters of the complete save) first.
"""
import os
import signal
import sys
from pathlib import Path

import numpy as np

import mindspore as ms
from mindspore import nn
from mindspore.communication import get_rank, init

import fullshard.mindspore as fs
from fullshard.checkpoint.formats import sharded_safetensors
from fullshard.train.msrun import register_worker
from tests.mindspore.parity import TinyLM, init_numpy, lm_batch, lm_loss, local_rows, wrap_layers


def main(out: Path) -> None:
    ms.set_context(mode=ms.PYNATIVE_MODE)
    ms.set_device("CPU")
    ms.device_context.cpu.op_tuning.threads_num(1)
    init()
    register_worker(get_rank())
    net = wrap_layers(init_numpy(TinyLM()))
    opt = nn.Adam(net.trainable_params(), learning_rate=1e-2)
    target = out / "ckpt"
    fs.save_checkpoint(net, target, opt)
    expected = fs.full_state_dict(net)
    if get_rank() == 0:
        np.savez(out / "expected.npz", **expected)
    ids, labels = lm_batch(0, 4)
    _, grads = ms.value_and_grad(lambda: lm_loss(net, local_rows(ids), local_rows(labels)), None, opt.parameters)()
    opt(grads)
    original = sharded_safetensors.write_rank

    def die_half_way(directory, rank, pieces):
        original(directory, rank, pieces)
        if rank == 1:
            path = Path(directory) / sharded_safetensors.rank_file(rank)
            with open(path, "r+b") as handle:
                handle.truncate(path.stat().st_size // 2)
            os.kill(os.getpid(), signal.SIGKILL)

    sharded_safetensors.write_rank = die_half_way
    fs.save_checkpoint(net, target, opt)
    raise AssertionError("the second save was not interrupted")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
