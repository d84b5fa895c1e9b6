"""The ownership sanitizer (FULLSHARD_CHECK_OWNERSHIP) on its own, without processes."""
import pytest
import torch

from fullshard.torch import collectives
from fullshard.torch.collectives import OwnershipError


@pytest.fixture(autouse=True)
def sanitizer_on():
    was = collectives.check_ownership_enabled()
    collectives.set_check_ownership(True)
    yield
    collectives.set_check_ownership(was)


def _claim(tensor, what, sources=()):
    """What every owned-buffer constructor of the runtime does with the tensor it made."""
    return collectives.Owned(tensor, what, collectives.TORCH_STORAGE, sources=sources)


def test_seed_bug_same_dtype_conversion_is_caught():
    """The seed: a same-dtype 'conversion' of a gradient claimed as owned. Caught by the source the site
    names even when nothing registered the gradient, and by the borrowed registry when a source is missing."""
    grad = torch.randn(8, 4)
    converted = grad.to(torch.float32).reshape(-1)  # returns the caller's storage
    with pytest.raises(OwnershipError, match=r"reduce-scatter input of \[w\].*shares storage with what it was made"):
        _claim(converted, "reduce-scatter input of [w] of module 'm'", sources=(grad,))
    lent = collectives.borrow(grad, "gradient of [w] of module 'm'")
    with pytest.raises(OwnershipError, match=r"gradient of \[w\] of module 'm'"):
        _claim(converted, "reduce-scatter input of [w] of module 'm'")
    lent.release()
    assert grad.untyped_storage().nbytes() == 8 * 4 * 4  # untouched


def test_a_view_of_any_source_is_caught_and_a_real_copy_is_not():
    grad, other = torch.randn(8, 4), torch.randn(3)
    with pytest.raises(OwnershipError, match=r"source 1"):
        _claim(grad[2:].view(-1), "packed input", sources=(other, grad))
    owned = _claim(grad.clone(), "packed input", sources=(other, grad))
    owned.reclaim()


def test_a_tensor_subclass_cannot_be_owned():
    """The review's case: a TwoTensor's ``to()`` returns itself, and it has no storage of its own to free."""
    from torch.testing._internal.two_tensor import TwoTensor

    replica = TwoTensor(torch.randn(4, 4), torch.randn(4, 4))
    assert replica.to("cpu", torch.float32) is replica
    with pytest.raises(OwnershipError, match="tensor subclass"):
        _claim(replica.to("cpu", torch.float32), "float32 copy of replica 'w'", sources=(replica,))
    with pytest.raises(OwnershipError, match="shares storage"):  # its inner tensors are what it reads
        _claim(replica.a.view(-1), "packed input of [w]", sources=(replica,))


def test_copy_of_really_copies_where_to_would_return_its_input():
    from torch.testing._internal.two_tensor import TwoTensor

    for source in (torch.randn(8, 4), TwoTensor(torch.randn(8, 4), torch.randn(8, 4))):
        owned = collectives.copy_of(source, torch.float32, torch.device("cpu"), "copy of 'w'")
        assert type(owned.tensor) is torch.Tensor
        owned.reclaim()
        assert source.untyped_storage().nbytes() > 0  # untouched


def test_a_real_cast_is_owned_and_can_be_reclaimed():
    grad = torch.randn(8, 4)
    lent = collectives.borrow(grad, "gradient")
    owned = collectives.copy_of(grad, torch.bfloat16, grad.device, "cast of gradient")
    owned.reclaim()
    assert owned.is_reclaimed and grad.untyped_storage().nbytes() > 0
    owned.regrow()
    assert not owned.is_reclaimed
    lent.release()


def test_a_copy_handed_out_is_checked_against_its_source(monkeypatch):
    output = torch.randn(16)
    copied = collectives.copy_out(output[:8], torch.float32, output.device, "sharded gradient of 'w'")
    assert copied.untyped_storage()._cdata != output.untyped_storage()._cdata
    monkeypatch.setattr(collectives, "_copy", lambda tensor, *args: tensor)  # a "copy" that returns its input
    with pytest.raises(OwnershipError, match="sharded gradient of 'w'"):
        collectives.copy_out(output[:8], torch.float32, output.device, "sharded gradient of 'w'")


def test_the_meter_counts_each_kind_apart():
    before = collectives.comm_bytes()
    kinds = {kind: collectives.allocate(4, torch.float32, torch.device("cpu"), kind.value, kind) for kind in collectives.Kind}
    after = collectives.comm_bytes()
    for kind in collectives.Kind:
        assert after[f"{kind.value}_live"] - before[f"{kind.value}_live"] == 16
    assert after["live"] - before["live"] == 48
    kinds[collectives.Kind.TRANSIENT].retag(collectives.Kind.MAIN_GRAD)  # a reduced buffer kept as a partial sum
    moved = collectives.comm_bytes()
    assert moved["transient_live"] == before["transient_live"] and moved["main_grad_live"] - before["main_grad_live"] == 32
    for owned in kinds.values():
        owned.reclaim()
    assert collectives.comm_bytes()["live"] == before["live"]


def test_owned_storage_that_is_also_lent_cannot_be_freed_or_written():
    owned = collectives.allocate(16, torch.float32, torch.device("cpu"), "padded input of [w]")
    view_lent_elsewhere = collectives.borrow(owned.tensor[:8], "someone's view")
    with pytest.raises(OwnershipError, match="free"):
        owned.reclaim()
    with pytest.raises(OwnershipError, match="scale"):
        owned.writable("scale")
    view_lent_elsewhere.release()
    owned.writable("scale").mul_(2)
    owned.reclaim()


def test_unknown_storage_cannot_be_freed():
    foreign = collectives.Owned.__new__(collectives.Owned)  # bypass registration: storage fullshard never allocated
    foreign.tensor, foreign.what, foreign.kind = torch.randn(4), "a tensor from elsewhere", collectives.Kind.TRANSIENT
    foreign._ops, foreign.resizable = collectives.TORCH_STORAGE, True
    foreign._nbytes, foreign._counted = 16, 0
    with pytest.raises(OwnershipError, match="not allocated by fullshard"):
        foreign.reclaim()


def test_borrowed_has_no_way_to_free_or_write():
    lent = collectives.borrow(torch.randn(4), "gradient")
    assert not hasattr(lent, "reclaim") and not hasattr(lent, "writable")


def test_handed_off_storage_is_no_longer_fullshards():
    owned = collectives.allocate(4, torch.float32, torch.device("cpu"), "reduce-scatter output")
    before = collectives.live_owned_buffers()
    grad = owned.hand_off()
    assert collectives.live_owned_buffers() == before - 1 and grad.numel() == 4


class _Work:
    def __init__(self, fails: bool) -> None:
        self.fails = fails

    def wait(self) -> None:
        if self.fails:
            raise RuntimeError("peer died")


@pytest.mark.parametrize("fails", [True, False])
def test_abandoned_reduction_frees_only_idle_buffers(fails):
    """After a collective's wait() raised, a backend thread may still write into its buffers: they
    are dropped (the storage goes with its last reference), never resized. Idle ones are reclaimed."""
    from fullshard.torch.buckets import PendingReduce

    before = collectives.comm_bytes()["live"]
    output = collectives.allocate(8, torch.float32, torch.device("cpu"), "reduce-scatter output")
    scratch = collectives.allocate(8, torch.float32, torch.device("cpu"), "receive buffer")
    still_referenced = [output.tensor, scratch.tensor]  # what a backend thread would still hold
    pending = PendingReduce(_Work(fails), [scratch], output, None, None, [], [True], 1.0, "[w] of module 'm'")
    pending.abandon()
    sizes = [t.untyped_storage().nbytes() for t in still_referenced]
    assert sizes == ([32, 32] if fails else [0, 0])
    assert collectives.comm_bytes()["live"] == before


def test_offload_copy_blocks_when_it_is_summed_at_once():
    from fullshard.plan import grad_copy_may_be_async

    assert grad_copy_may_be_async(pinned=True, accumulates=False)
    assert not grad_copy_may_be_async(pinned=True, accumulates=True)
    assert not grad_copy_may_be_async(pinned=False, accumulates=False)
