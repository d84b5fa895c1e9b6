"""Parity of a sharded MindSpore model against a single-process reference, run inside each msrun worker.

Every rank builds the same tiny model from the same numpy seed. The reference
copy trains on the whole global batch in this process (no communication):
``value_and_grad`` + ``nn.Adam``. The sharded copy trains on this rank's rows
of the batch. Per-step losses (averaged over the ranks) and the final full
parameters (``full_state_dict``) must match.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np

import mindspore as ms
from mindspore import Parameter, Tensor, mint, nn, ops
from mindspore.communication import get_group_size, get_rank

import fullshard.mindspore as fs

FP32_ATOL, FP32_RTOL = 1e-5, 1e-4


class Block(nn.Cell):
    def __init__(self, d: int, h: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm((d,))
        self.fc1 = nn.Dense(d, h)
        self.fc2 = nn.Dense(h, d)

    def construct(self, x: Tensor) -> Tensor:
        return x + self.fc2(ops.gelu(self.fc1(self.norm(x))))


class TinyLM(nn.Cell):
    """Embedding (vocab 7: uneven on 2 ranks), blocks, a final norm and a head; optionally tied."""

    def __init__(self, vocab: int = 7, d: int = 8, h: int = 16, layers: int = 2, tied: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.layers = nn.CellList([Block(d, h) for _ in range(layers)])
        self.norm = nn.LayerNorm((d,))
        self.tied = tied
        if not tied:
            self.head = nn.Dense(d, vocab, has_bias=False)

    def construct(self, ids: Tensor) -> Tensor:
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x)
        x = self.norm(x)
        weight = self.emb.embedding_table if self.tied else self.head.weight
        return mint.matmul(x, weight.swapaxes(0, 1))


class TiedTwice(TinyLM):
    """The head's weight *is* the embedding table: one Parameter registered in two cells."""

    def __init__(self):
        super().__init__(tied=False)
        self.head.weight = self.emb.embedding_table


class Concatenated(nn.Cell):
    """Two parameters concatenated in construct: autograd hands their gradients out as views of one storage."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.top = Parameter(Tensor(np.zeros((4, d), np.float32)), name="top")  # even: borrowed gradient
        self.bottom = Parameter(Tensor(np.zeros((5, d), np.float32)), name="bottom")  # padded: packed

    def construct(self, x):
        return mint.matmul(x, mint.cat([self.top, self.bottom], 0).swapaxes(0, 1))


class ConcatLM(TinyLM):
    def __init__(self):
        super().__init__(layers=1)
        self.mix = Concatenated()
        self.out = nn.Dense(9, 7, has_bias=False)

    def construct(self, ids):
        x = self.layers[0](self.emb(ids))
        return self.out(self.mix(self.norm(x)))


def init_numpy(net: nn.Cell, seed: int = 0) -> nn.Cell:
    """Deterministic parameters, the same on every rank and for every copy."""
    rng = np.random.RandomState(seed)
    for name, param in net.parameters_and_names():
        scale = 0.5 if param.ndim > 1 else 0.1
        base = 1.0 if name.endswith("gamma") else 0.0
        param.set_data(Tensor((base + scale * rng.randn(*param.shape)).astype(np.float32), dtype=param.dtype))
    return net


def rank() -> int:
    return get_rank()


def world() -> int:
    return get_group_size()


def lm_batch(step: int, batch: int, vocab: int = 7, seq: int = 5) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.RandomState(1000 + step)
    return rng.randint(0, vocab, (batch, seq)).astype(np.int32), rng.randint(0, vocab, (batch, seq)).astype(np.int32)


def lm_loss(net: nn.Cell, ids: np.ndarray, labels: np.ndarray) -> Tensor:
    logits = net(Tensor(ids))
    return ops.cross_entropy(logits.reshape(-1, logits.shape[-1]).astype(ms.float32), Tensor(labels.reshape(-1)))


def mean_over_ranks(value: float) -> float:
    return float(ops.AllReduce()(Tensor(np.array([value], np.float32))).asnumpy()[0]) / world()


def local_rows(array: np.ndarray, dp_rank: Optional[int] = None, dp_size: Optional[int] = None) -> np.ndarray:
    dp_rank = rank() if dp_rank is None else dp_rank
    dp_size = world() if dp_size is None else dp_size
    rows = array.shape[0] // dp_size
    return array[dp_rank * rows:(dp_rank + 1) * rows]


def shard_of(full: np.ndarray, param: Parameter) -> np.ndarray:
    """This rank's chunk of a full array, for a sharded Parameter (the array itself for others)."""
    sharded = param._fullshard_param if hasattr(param, "_fullshard_param") else None
    if sharded is None or sharded.replicated:
        return full
    layout = sharded.layout
    start, length = layout.local_offset(sharded.rank), layout.local_length(sharded.rank)
    return np.take(full, range(start, start + length), axis=layout.dim)


def assert_close(got: np.ndarray, want: np.ndarray, what: str, atol: float = FP32_ATOL, rtol: float = FP32_RTOL) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, f"{what}: shape {got.shape}, expected {want.shape}"
    err = float(np.abs(got - want).max()) if got.size else 0.0
    assert np.allclose(got, want, atol=atol, rtol=rtol), f"{what}: max abs error {err:.3g} (atol {atol}, rtol {rtol})"
    return err


def gathered_bytes(state) -> int:
    """Bytes one gather of a unit carries (every rank's padded chunks), from its plan."""
    from fullshard.mindspore.collectives import dtype_bytes

    return sum(b.total_numel * dtype_bytes(g.plan.members(i)[0].compute_dtype)
               for g in state.groups for i, b in enumerate(g.plan.buckets))


@dataclass
class Parity:
    """What a parity run measured (returned by scenarios as data)."""

    losses: list = field(default_factory=list)
    reference_losses: list = field(default_factory=list)
    max_param_error: float = 0.0
    max_grad_error: float = 0.0

    def as_dict(self) -> dict:
        return {"losses": self.losses, "reference_losses": self.reference_losses,
                "max_param_error": self.max_param_error, "max_grad_error": self.max_grad_error}


def wrap_layers(net: nn.Cell, **kwargs: Any) -> nn.Cell:
    """Per-layer units, then the root (the usual wrapping)."""
    for layer in net.layers:
        fs.fully_shard(layer, **kwargs)
    fs.fully_shard(net, **kwargs)
    return net


def run_parity(
    build: Callable[[], nn.Cell] = TinyLM,
    wrap: Callable[[nn.Cell], Any] = wrap_layers,
    steps: int = 3,
    batch: int = 4,
    lr: float = 1e-2,
    atol: float = FP32_ATOL,
    rtol: float = FP32_RTOL,
    grad_scale: float = 1.0,
    before_step: Optional[Callable[[nn.Cell, int], None]] = None,
    dp_rank: Optional[int] = None,
    dp_size: Optional[int] = None,
    loss_fn: Callable = lm_loss,
    data: Callable = lm_batch,
    step_on: Optional[Callable[[list, tuple], tuple]] = None,
    optimize: bool = True,
) -> Parity:
    """Train a sharded copy and a reference copy side by side; assert they agree step by step.

    ``grad_scale``: the sharded gradients are the reference's times this (a sum over ranks gives
    the world size); the reference then steps on its gradients scaled alike. ``step_on(params,
    grads)``: what the sharded optimizer steps on (default: the returned gradients).
    ``optimize=False``: compare gradients only (e.g. dtypes MindSpore's CPU Adam has no kernel for).
    """
    reference = init_numpy(build())
    sharded = init_numpy(build())
    wrap(sharded)
    ref_params = reference.trainable_params()
    params = sharded.trainable_params()
    if optimize:
        ref_opt = nn.Adam(ref_params, learning_rate=lr)
        opt = nn.Adam(params, learning_rate=lr)
    result = Parity()
    for step in range(steps):
        ids, labels = data(step, batch)
        if before_step is not None:
            before_step(sharded, step)
        loss, grads = ms.value_and_grad(lambda: loss_fn(sharded, local_rows(ids, dp_rank, dp_size),
                                                        local_rows(labels, dp_rank, dp_size)), None, params)()
        ref_loss, ref_grads = ms.value_and_grad(lambda: loss_fn(reference, ids, labels), None, ref_params)()
        for param, ref_param, grad, ref_grad in zip(params, ref_params, grads, ref_grads):
            assert param.name == ref_param.name, (param.name, ref_param.name)
            want = shard_of(ref_grad.asnumpy() * grad_scale, param)
            result.max_grad_error = max(result.max_grad_error, assert_close(
                grad.astype(ms.float32).asnumpy(), want, f"step {step} gradient of {param.name}", atol, rtol))
        result.losses.append(mean_over_ranks(float(loss.asnumpy())) if dp_size != 1 else float(loss.asnumpy()))
        result.reference_losses.append(float(ref_loss.asnumpy()))
        assert abs(result.losses[-1] - result.reference_losses[-1]) <= atol + rtol * abs(result.reference_losses[-1]), (
            f"step {step}: loss {result.losses[-1]} vs reference {result.reference_losses[-1]}")
        if optimize:
            opt(step_on(params, grads) if step_on is not None else grads)
            ref_opt(tuple(g * grad_scale for g in ref_grads) if grad_scale != 1 else ref_grads)
    full = fs.full_state_dict(sharded)
    for name, param in reference.parameters_and_names():
        result.max_param_error = max(result.max_param_error, assert_close(full[name], param.asnumpy(),
                                                                          f"final {name}", atol, rtol))
    assert set(full) == {n for n, _ in reference.parameters_and_names()}
    return result
