"""The ownership sanitizer (FULLSHARD_CHECK_OWNERSHIP) on its own, without processes."""
import pytest
import torch

from fullshard.torch import buffers
from fullshard.torch.buffers import OwnershipError


@pytest.fixture(autouse=True)
def sanitizer_on():
    was = buffers.check_ownership_enabled()
    buffers.set_check_ownership(True)
    yield
    buffers.set_check_ownership(was)


def test_seed_bug_same_dtype_conversion_is_caught():
    """The seed: a same-dtype 'conversion' of a borrowed gradient adopted as owned, then freed."""
    grad = torch.randn(8, 4)
    lent = buffers.borrow(grad, "gradient of [w] of module 'm'")
    converted = grad.to(torch.float32).reshape(-1)  # returns the caller's storage
    with pytest.raises(OwnershipError, match=r"gradient of \[w\] of module 'm'"):
        buffers.adopt(converted, "reduce-scatter input of [w] of module 'm'")
    lent.release()
    assert grad.untyped_storage().nbytes() == 8 * 4 * 4  # untouched


def test_a_real_cast_is_owned_and_can_be_reclaimed():
    grad = torch.randn(8, 4)
    lent = buffers.borrow(grad, "gradient")
    owned = buffers.adopt(grad.to(torch.bfloat16), "cast of gradient")
    owned.reclaim()
    assert owned.is_reclaimed and grad.untyped_storage().nbytes() > 0
    owned.regrow()
    assert not owned.is_reclaimed
    lent.release()


def test_owned_storage_that_is_also_lent_cannot_be_freed_or_written():
    owned = buffers.allocate(16, torch.float32, torch.device("cpu"), "padded input of [w]")
    view_lent_elsewhere = buffers.borrow(owned.tensor[:8], "someone's view")
    with pytest.raises(OwnershipError, match="free"):
        owned.reclaim()
    with pytest.raises(OwnershipError, match="scale"):
        owned.writable("scale")
    view_lent_elsewhere.release()
    owned.writable("scale").mul_(2)
    owned.reclaim()


def test_unknown_storage_cannot_be_freed():
    foreign = buffers.Owned.__new__(buffers.Owned)  # bypass registration: storage fullshard never allocated
    foreign.tensor, foreign.what, foreign.working = torch.randn(4), "a tensor from elsewhere", False
    foreign._ops, foreign.resizable = buffers.TORCH_STORAGE, True
    foreign._nbytes, foreign._counted = 16, 0
    with pytest.raises(OwnershipError, match="not allocated by fullshard"):
        foreign.reclaim()


def test_borrowed_has_no_way_to_free_or_write():
    lent = buffers.borrow(torch.randn(4), "gradient")
    assert not hasattr(lent, "reclaim") and not hasattr(lent, "writable")


def test_handed_off_storage_is_no_longer_fullshards():
    owned = buffers.allocate(4, torch.float32, torch.device("cpu"), "reduce-scatter output")
    before = buffers.live_owned_buffers()
    grad = owned.hand_off()
    assert buffers.live_owned_buffers() == before - 1 and grad.numel() == 4


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
    from fullshard.torch.collectives import PendingReduce

    before = buffers.comm_bytes()["live"]
    output = buffers.allocate(8, torch.float32, torch.device("cpu"), "reduce-scatter output")
    scratch = buffers.allocate(8, torch.float32, torch.device("cpu"), "receive buffer")
    still_referenced = [output.tensor, scratch.tensor]  # what a backend thread would still hold
    pending = PendingReduce(_Work(fails), [scratch], output, None, None, [], [], 1.0, "[w] of module 'm'")
    pending.abandon()
    sizes = [t.untyped_storage().nbytes() for t in still_referenced]
    assert sizes == ([32, 32] if fails else [0, 0])
    assert buffers.comm_bytes()["live"] == before


def test_offload_copy_blocks_when_it_is_summed_at_once():
    from fullshard.plan import grad_copy_may_be_async

    assert grad_copy_may_be_async(pinned=True, accumulates=False)
    assert not grad_copy_may_be_async(pinned=True, accumulates=True)
    assert not grad_copy_may_be_async(pinned=False, accumulates=False)
