"""Which fullshard files one parameter's life runs through: a 2-block model is wrapped (each block, then the
root) and trained two steps, and every ``fullshard/`` file one of whose functions ran meanwhile is recorded
(``sys.setprofile`` on every thread). Imports happen before the trace: a module that is only imported does
not count, one whose function runs does."""
from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Callable

PACKAGE = str(Path(__file__).resolve().parents[2] / "fullshard") + "/"


def files_run_by(work: Callable[[], None]) -> list[str]:
    seen: set[str] = set()

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(PACKAGE):
            seen.add(frame.f_code.co_filename[len(PACKAGE):])

    sys.setprofile(profile)
    threading.setprofile(profile)
    try:
        work()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    return sorted(seen)


def torch_parameter_life() -> list[str]:
    """The fullshard files the torch runtime runs through (inside a gloo rank of a 2-rank group)."""
    import torch
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh

    from fullshard import fully_shard

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)

        def forward(self, x):
            return x + self.fc2(torch.relu(self.fc1(x)))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.layers, self.head = nn.Embedding(10, 8), nn.ModuleList([Block(), Block()]), nn.Linear(8, 10)

        def forward(self, tokens):
            x = self.emb(tokens)
            for layer in self.layers:
                x = layer(x)
            return self.head(x)

    def life() -> list[str]:
        torch.manual_seed(0)
        net, mesh = Net(), init_device_mesh("cpu", (2,))

        def work() -> None:
            for layer in net.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(net, mesh=mesh)
            optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
            for _ in range(2):
                net(torch.randint(0, 10, (2, 5))).pow(2).mean().backward()
                optimizer.step()
                optimizer.zero_grad()

        return files_run_by(work)

    return life()


def mindspore_parameter_life() -> list[str]:
    """The fullshard files the MindSpore runtime runs through (inside an msrun worker of 2)."""
    import numpy as np

    import mindspore as ms
    from mindspore import Tensor, nn, ops

    import fullshard.mindspore as fs

    class Block(nn.Cell):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.fc2 = nn.Dense(8, 16), nn.Dense(16, 8)

        def construct(self, x):
            return x + self.fc2(ops.relu(self.fc1(x)))

    class Net(nn.Cell):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.layers, self.head = nn.Embedding(10, 8), nn.CellList([Block(), Block()]), nn.Dense(8, 10)

        def construct(self, tokens):
            x = self.emb(tokens)
            for layer in self.layers:
                x = layer(x)
            return self.head(x)

    def life() -> list[str]:
        net, mesh = Net(), fs.init_device_mesh("cpu", (2,))
        tokens = Tensor(np.random.default_rng(0).integers(0, 10, (2, 5)).astype(np.int32))

        def work() -> None:
            for layer in net.layers:
                fs.fully_shard(layer, mesh=mesh)
            fs.fully_shard(net, mesh=mesh)
            optimizer = nn.SGD(net.trainable_params(), learning_rate=0.1)
            for _ in range(2):
                _, grads = ms.value_and_grad(lambda: net(tokens).pow(2).mean(), None, optimizer.parameters)()
                optimizer(grads)

        return files_run_by(work)

    return life()
