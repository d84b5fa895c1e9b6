"""Publishing a checkpoint is crash-safe at every step, on both frameworks' formats.

Checkpoint A exists at ``step_1`` (with a stale ``step_1.replaced`` beside
it, as an earlier crash may leave one); saving B over it crashes before each
file-system call of ``publish`` in turn (and half way through each removal).
After every crash the loaders, ``latest_step`` and ``fullshard export`` find
a complete checkpoint: A while ``step_1`` still holds it, B once the old one
was moved aside (from ``step_1.partial``, with a warning naming both paths).
"""
from __future__ import annotations

import contextlib
import io
import os
import shutil
import warnings

import numpy as np
import pytest
import torch

from fullshard import cli
from fullshard.checkpoint import publish as publishing
from fullshard.checkpoint.publish import RecoveredCheckpointWarning, latest_step, partial_dir, replaced_dir, step_dir

# publish's file-system calls, in order, when step_1 and a stale step_1.replaced exist
CALLS = ["rmtree stale .replaced", "replace step_1 to .replaced", "replace .partial to step_1", "fsync root",
         "rmtree .replaced"]
# (crash before call k, or half way through it) -> what step_1 resolves to
CRASHES = [(k, False) for k in range(len(CALLS) + 1)] + [(0, True), (4, True)]


class Crash(Exception):
    pass


@contextlib.contextmanager
def crashing_at(call: int, half_way: bool):
    """Make publish's ``call``-th file-system call crash (before it, or after removing one file)."""
    seen = []
    real_replace, real_rmtree, real_fsync = os.replace, shutil.rmtree, publishing.fsync_dir

    def counted(real, name):
        def wrapper(*args, **kwargs):
            seen.append(name)
            if len(seen) - 1 == call:
                if half_way:
                    first = sorted(os.listdir(args[0]))[0]
                    os.unlink(os.path.join(args[0], first))
                raise Crash(f"crash at {name}")
            return real(*args, **kwargs)
        return wrapper

    def publish(final):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(os, "replace", counted(real_replace, "replace"))
            patch.setattr(shutil, "rmtree", counted(real_rmtree, "rmtree"))
            patch.setattr(publishing, "fsync_dir", counted(real_fsync, "fsync"))
            return real_publish(final)

    real_publish = publishing.publish
    yield publish, seen


# ---------------------------------------------------------------------- the two formats
class TorchFormat:
    name = "torch"

    def __init__(self):
        self.module = torch.nn.Linear(4, 3)

    def save(self, root, value: float) -> None:
        from fullshard.torch.checkpoint import save_checkpoint

        with torch.no_grad():
            self.module.weight.fill_(value)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            save_checkpoint(self.module, step_dir(root, 1))

    def load(self, root) -> float:
        from fullshard.torch.checkpoint import load_checkpoint

        with torch.no_grad():
            self.module.weight.zero_()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
            load_checkpoint(self.module, step_dir(root, latest_step(root)))
        return float(self.module.weight[0, 0])

    def exported(self, out) -> float:
        return float(torch.load(out, weights_only=True)["weight"][0, 0])

    suffix = ".pt"


class MindSporeFormat:
    name = "mindspore"

    def __init__(self):
        import mindspore as ms
        from mindspore import nn

        ms.set_context(mode=ms.PYNATIVE_MODE)
        ms.set_device("CPU")
        self.ms, self.cell = ms, nn.Dense(4, 3)

    def save(self, root, value: float) -> None:
        import fullshard.mindspore as fs

        self.cell.weight.set_data(self.ms.Tensor(np.full((3, 4), value, np.float32)))
        fs.save_checkpoint(self.cell, step_dir(root, 1))

    def load(self, root) -> float:
        import fullshard.mindspore as fs

        self.cell.weight.set_data(self.ms.Tensor(np.zeros((3, 4), np.float32)))
        fs.load_checkpoint(self.cell, step_dir(root, latest_step(root)))
        return float(self.cell.weight.asnumpy()[0, 0])

    def exported(self, out) -> float:
        from fullshard.checkpoint.formats.safetensors_file import TensorFile

        return float(TensorFile(out).read("weight").data[0, 0])

    suffix = ".safetensors"


@pytest.fixture(scope="module", params=["torch", "mindspore"])
def fmt(request):
    if request.param == "mindspore":
        pytest.importorskip("mindspore")
        return MindSporeFormat()
    return TorchFormat()


def _expected(call: int, half_way: bool) -> tuple[float, bool]:
    """The value step_1 loads after the crash (A=1, B=2), and whether it comes from beside step_1."""
    if half_way:
        return (1.0, False) if call == 0 else (2.0, False)
    if call <= 1:
        return 1.0, False  # step_1 still holds A
    if call == 2:
        return 2.0, True  # A moved aside: B is the complete .partial
    return 2.0, False


@pytest.mark.parametrize("call, half_way", CRASHES,
                         ids=[f"{'half way through' if h else 'before'} {CALLS[k] if k < len(CALLS) else 'nothing'}"
                              for k, h in CRASHES])
def test_a_crash_at_any_step_of_publish_leaves_a_complete_checkpoint(fmt, tmp_path, call, half_way):
    root = tmp_path / "ckpt"
    fmt.save(root, 0.0)
    shutil.copytree(step_dir(root, 1), replaced_dir(step_dir(root, 1)))  # a stale one an earlier crash left
    fmt.save(root, 1.0)  # A
    shutil.copytree(step_dir(root, 1), replaced_dir(step_dir(root, 1)))
    with crashing_at(call, half_way) as (publish, seen), pytest.MonkeyPatch.context() as patch:
        patch.setattr(publishing, "publish", publish)  # both runtimes save through publishing.save_together
        if call < len(CALLS):
            with pytest.raises(Crash):
                fmt.save(root, 2.0)  # B
        else:
            fmt.save(root, 2.0)
    assert seen == [c.split()[0] for c in CALLS][:call + 1], seen  # the crash came where it was meant to
    value, beside = _expected(call, half_way)
    assert latest_step(root) == 1
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RecoveredCheckpointWarning)
        assert fmt.load(root) == value
    recovered = [w for w in caught if issubclass(w.category, RecoveredCheckpointWarning)]
    assert bool(recovered) == beside, [str(w.message) for w in caught]
    if beside:
        message = str(recovered[0].message)
        assert str(step_dir(root, 1)) in message and str(partial_dir(step_dir(root, 1))) in message
    _check_export(fmt, root, tmp_path, value, beside)
    # the next save of that step repairs everything
    fmt.save(root, 3.0)
    assert sorted(p.name for p in root.iterdir()) == ["step_1"] and fmt.load(root) == 3.0


def _check_export(fmt, root, tmp_path, value, beside) -> None:
    out = tmp_path / f"export{fmt.suffix}"
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        assert cli.main(["export", str(step_dir(root, 1)), str(out)]) == 0, err.getvalue()
    assert fmt.exported(out) == value
    lines = err.getvalue().splitlines()
    assert len(lines) == (1 if beside else 0) and all(line.startswith("fullshard export: warning:") for line in lines)


def test_publish_refuses_a_partial_without_its_manifest(tmp_path):
    publishing.start_partial(tmp_path / "step_1")
    with pytest.raises(RuntimeError, match="has no fullshard.manifest.json"):
        publishing.publish(tmp_path / "step_1")


def test_a_partial_cut_short_is_never_taken(tmp_path):
    """A save killed before its manifest: no step, and a damaged .partial beside a missing step is not taken."""
    TorchFormat().save(tmp_path, 1.0)
    os.rename(step_dir(tmp_path, 1), partial_dir(step_dir(tmp_path, 1)))
    assert latest_step(tmp_path) == 1  # complete and verified: a crash after the manifest, before the rename
    victim = next(p for p in partial_dir(step_dir(tmp_path, 1)).iterdir() if p.suffix == ".distcp")
    victim.write_bytes(victim.read_bytes()[:-1])
    assert latest_step(tmp_path) is None
    assert publishing.resolve(step_dir(tmp_path, 1)) == step_dir(tmp_path, 1)  # missing: the loader says so
