"""The MindSpore 2.10 facts the plan's MINDSPORE_RUNTIME row states, checked on real tensors (one process
each, CPU, no communication). If an upgrade changes one, this fails before the runtime misbehaves."""
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("mindspore")

_SETUP = """
import numpy as np
import mindspore as ms
from mindspore import Parameter, Tensor, mint, nn, ops
ms.set_context(mode=ms.PYNATIVE_MODE)
ms.set_device("CPU")
ms.device_context.cpu.op_tuning.threads_num(1)
def ptr(t):
    return t.untyped_storage().data_ptr()
"""


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _SETUP + textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=120)


def _check(code: str) -> None:
    done = _run(code)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]


def test_what_aliases_and_what_allocates():
    """The seed's fact: a same-dtype astype/to and every reshape alias; a cast to another dtype, cat and
    copy allocate. The plan marks the first BORROWED, the others OWNED."""
    _check("""
        g = mint.cat([Tensor(np.ones((8, 4), np.float32))])
        assert ptr(g.astype(ms.float32)) == ptr(g) and ptr(g.to(ms.float32).reshape(-1)) == ptr(g)
        assert ptr(g.astype(ms.float16)) != ptr(g)
        assert ptr(mint.cat([g])) != ptr(g) and ptr(g.copy()) != ptr(g)
        alias = g.astype(ms.float32).reshape(-1)
        alias.untyped_storage().resize_(0)
        assert g.untyped_storage().nbytes() == 0  # freeing the alias frees the caller's tensor
    """)


def test_in_place_arithmetic_is_not_in_place_on_cpu():
    """RuntimeFacts.in_place_arithmetic is off: div_ returns a new tensor; ops.assign_add writes in place."""
    _check("""
        t = mint.cat([Tensor(np.full(4, 2.0, np.float32))])
        t.div_(2.0)
        assert float(t.asnumpy()[0]) == 2.0, "div_ became in place: MINDSPORE_RUNTIME may allow it"
        ops.assign_add(t, Tensor(np.ones(4, np.float32)))
        assert float(t.asnumpy()[0]) == 3.0
    """)


_SAVED = """
    class Gather(nn.Cell):
        def construct(self, shard):
            flat = mint.cat([shard.reshape(-1)])
            return flat.reshape(64, 64) if VIEW else mint.cat([shard.reshape(64, 64)])
        def bprop(self, shard, out, dout):
            return (dout.reshape(-1),)
    w = Parameter(Tensor(np.full(4096, 3.0, np.float32)), name="w")
    gather = Gather()
    def loss():
        full = gather(w)
        y = full * full  # backward reads full
        full.untyped_storage().resize_(0)
        junk = [ops.ones((4096,), ms.float32) * 7 for _ in range(8)]
        return y.sum()
    _, grads = ms.value_and_grad(loss, None, [w])()
    print("MEAN", float(grads[0].asnumpy().mean()))
"""


def test_a_view_handed_to_autograd_outlives_its_reclaimed_storage():
    """RuntimeFacts.reclaims_views is off: resizing a view's storage to 0 leaves autograd's data intact
    (the memory is not freed), so the runtime never hands out views of storage it reclaims."""
    done = _run("VIEW = True\n" + textwrap.dedent(_SAVED))
    assert done.returncode == 0 and "MEAN 6.0" in done.stdout, done.stdout[-2000:] + done.stderr[-2000:]


def test_a_tensor_of_its_own_is_really_freed():
    """...while a tensor with storage of its own is: backward then reads freed memory (wrong values, or a
    crash), which is why the runtime gathers into that storage again before backward."""
    done = _run("VIEW = False\n" + textwrap.dedent(_SAVED))
    assert done.returncode != 0 or "MEAN 6.0" not in done.stdout, done.stdout[-2000:]


_RAISING_FORWARD = """
    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm((4,))
            self.fc = nn.Dense(4, 4)

        def construct(self, x, fail=False):
            x = self.norm(x)
            if fail:
                raise RuntimeError("injected")
            return self.fc(x).sum()

    net = Net()
    x = Tensor(np.ones((2, 4), np.float32))
    grad = ms.value_and_grad(lambda fail: net(x, fail), None, net.trainable_params())
    try:
        grad(True)
    except RuntimeError:
        pass
    CLEANUP
    grad(False)
"""


def test_a_recorded_forward_that_raises_breaks_the_next_backward_until_its_recording_is_dropped():
    """value_and_grad opens a graph for its function and closes it only when the function returns: after a
    raise the next call records inside the broken one and its backward fails, without fullshard too. Dropping
    the recording (what fullshard.mindspore.autograd.drop_failed_recording does) gives a working next step."""
    broken = _run(_RAISING_FORWARD.replace("CLEANUP", "pass"))
    assert broken.returncode != 0 and "out of range" in broken.stderr, broken.stderr[-2000:]
    _check(_RAISING_FORWARD.replace("CLEANUP", "from mindspore.common.api import _pynative_executor\n"
                                               "    _pynative_executor.clear_res()"))
