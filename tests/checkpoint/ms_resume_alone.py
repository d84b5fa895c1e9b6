"""One process, no distributed init: resume a 2-worker checkpoint (2 -> 1) and export it for plain MindSpore.

Run by tests/checkpoint/test_mindspore.py: ``python -m tests.checkpoint.ms_resume_alone OUT``, where OUT holds
what its scenarios wrote. Prints one JSON line.
"""
import json
import sys
from pathlib import Path

import numpy as np

import mindspore as ms
from mindspore import nn

import fullshard.mindspore as fs
from fullshard.checkpoint.publish import step_dir
from tests.mindspore.parity import TinyLM, init_numpy, lm_batch, lm_loss
from tests.checkpoint.test_mindspore import LR, SAVE_AT, STEPS


def main(out: Path) -> None:
    ms.set_context(mode=ms.PYNATIVE_MODE)
    ms.set_device("CPU")
    checkpoint = step_dir(out / "ckpt", SAVE_AT)
    net = init_numpy(TinyLM(), seed=9)
    opt = nn.Adam(net.trainable_params(), learning_rate=LR)
    fs.load_checkpoint(net, checkpoint, opt)
    losses = []
    for step in range(SAVE_AT, STEPS):  # the whole global batch in one process
        ids, labels = lm_batch(step, 4)
        loss, grads = ms.value_and_grad(lambda: lm_loss(net, ids, labels), None, opt.parameters)()
        opt(grads)
        losses.append(float(loss.asnumpy()))
    exported = fs.export_checkpoint(checkpoint, out / "model.safetensors")
    plain = init_numpy(TinyLM(), seed=11)
    ms.load_checkpoint(str(exported), net=plain, format="safetensors")
    saved = np.load(out / "saved_params.npz")
    identical = {name: bool(np.array_equal(param.asnumpy(), saved[name])) for name, param in plain.parameters_and_names()}
    print(json.dumps({"losses": losses, "identical": identical, "names": sorted(saved.files)}))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
