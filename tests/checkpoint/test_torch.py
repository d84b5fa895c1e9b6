"""torch checkpoints on gloo ranks: state dicts, DCP save/load/reshard, resume, FSDP2 interop, checks, failed saves
(2 ranks); the world size changed between save and load (4 ranks); the sharded checkpoints loaded and exported in
this process, with no process group, compared bit for bit.

Checkpoints go under ``$FULLSHARD_TEST_DIR`` (the module's directory, shared by every rank, both world sizes
and the tests here): ``ws2/step_2`` is a model + AdamW checkpoint saved at 2 ranks, and ``expected_ws2.pt``
its full state dict (written by rank 0) that every later load is compared with, bit for bit; the 4 ranks
load it, train a step and save ``ws4/step_3`` (``expected_ws4.pt``).
"""
from __future__ import annotations

import contextlib
import copy
import errno
import os
import time
from pathlib import Path
from typing import Any, Callable
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode
from torch.utils._pytree import tree_map

import fullshard.core.buffers as traffic_meter
from fullshard import FSDPModule
from fullshard.checkpoint import manifest, publish, latest_step, step_dir
from fullshard.checkpoint.publish import RanksFailed
from fullshard.checkpoint.untrusted import CheckpointError
from fullshard.torch.checkpoint import (export_checkpoint, full_state_dict, load_checkpoint, load_full_state_dict,
                                        load_state_dict, save_checkpoint, save_state_dict)
from fullshard.models.gpt import GPT, GPTConfig
from tests.checkpoint.states import assert_same
from tests.conftest import Launch, scenario
from tests.torch.parity import gpt_batch, gpt_loss, mesh_1d, shard_blocks_then_root

LAUNCH = Launch(world_sizes=(2,), timeout_s=900)
SAVED = "dcp_save_world_size_2"  # the checkpoint many scenarios (and tests here) load

# Odd sizes, so that Shard(0) is uneven at 2 and 4 ranks (67 = 34 + 33 = 17 * 3 + 16; 13 = 4 * 3 + 1).
CFG = GPTConfig(vocab_size=67, seq_len=13, d_model=36, n_layers=2, n_heads=4)
GLOBAL_BATCH = 4
# A save that failed on one rank must raise on every rank within this, far inside the group's timeout
# (tests.conftest.COLLECTIVE_TIMEOUT_S): a rank left waiting in a collective would take all of that.
FAILED_SAVE_WITHIN_S = 10
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def ckpt_root() -> Path:
    return Path(os.environ["FULLSHARD_TEST_DIR"])


def shard_last_dim(param: torch.nn.Parameter) -> Shard:
    return Shard(param.dim() - 1)


def build(seed: int, cfg: GPTConfig = CFG) -> GPT:
    torch.manual_seed(seed)
    return GPT(cfg)


def sharded(seed: int, cfg: GPTConfig = CFG, **kwargs) -> GPT:
    return shard_blocks_then_root(build(seed, cfg), mesh=mesh_1d(), **kwargs)


def torch_sharded(seed: int) -> GPT:
    """The same model and wrapping under PyTorch's own FSDP2."""
    model = build(seed)
    for layer in model.layers:
        torch_fully_shard(layer, mesh=mesh_1d())
    torch_fully_shard(model, mesh=mesh_1d())
    return model


def adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def local_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    batch = gpt_batch(step, GLOBAL_BATCH, CFG)
    return tuple(t.chunk(dist.get_world_size())[dist.get_rank()] for t in batch)


def train(model: torch.nn.Module, optim: torch.optim.Optimizer, steps: range) -> list[float]:
    """Plain data-parallel steps on this rank's slice of each global batch; returns the local losses."""
    losses = []
    for step in steps:
        loss = gpt_loss(model, local_batch(step))
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses


def local_chunk(full: torch.Tensor, dim: int) -> torch.Tensor:
    """This rank's part of ``full`` under ``Shard(dim)`` (DTensor's rule: ceil-sized chunks, trailing ones short)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    size = full.shape[dim]
    chunk = -(-size // world)
    start = min(rank * chunk, size)
    return full.narrow(dim, start, max(0, min(chunk, size - start)))


def clone_state(state: Any) -> Any:
    """A detached copy (DTensors stay DTensors: clone is local)."""
    return tree_map(lambda v: v.detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v), state)




def full_state(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict:
    """Full, plain CPU state dict on rank 0 (empty elsewhere); collective."""
    model_sd, optim_sd = get_state_dict(model, optim, options=FULL)
    return {"model": model_sd, "optim": optim_sd}


def train_state(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict:
    model_sd, optim_sd = get_state_dict(model, optim)
    return {"model": model_sd, "optim": optim_sd}


def assert_matches_expected(model: torch.nn.Module, optim: torch.optim.Optimizer, expected_file: str) -> None:
    full = full_state(model, optim)
    if dist.get_rank() == 0:
        assert_same(full, torch.load(ckpt_root() / expected_file, weights_only=True))
    else:
        assert full == {"model": {}, "optim": {}}, "cpu_offload full state dicts live on rank 0 only"


def write_expected(model: torch.nn.Module, optim: torch.optim.Optimizer, name: str) -> None:
    full = full_state(model, optim)
    if dist.get_rank() == 0:
        torch.save(full, ckpt_root() / name)
    dist.barrier()


def raises(fn: Callable[[], Any], error: type, *fragments: str) -> str:
    try:
        fn()
    except error as caught:
        message = str(caught)
        for fragment in fragments:
            assert fragment in message, f"{fragment!r} not in error:\n{message}"
        return message
    raise AssertionError(f"expected {error.__name__}")


# ---------------------------------------------------------------------- 1. model.state_dict()
def _check_state_dict(model: GPT, ref: GPT, placement_of: Callable[[torch.Tensor], Any], where: str) -> None:
    traffic = dict(traffic_meter.traffic)
    with CommDebugMode() as comm:
        sd = model.state_dict()
    assert comm.get_total_counts() == 0, f"{where}: state_dict() communicated: {comm.get_comm_counts()}"
    assert dict(traffic_meter.traffic) == traffic, f"{where}: state_dict() moved bytes through fullshard"
    ref_sd = ref.state_dict()
    assert list(sd) == list(ref_sd), f"{where}: keys {list(sd)}"
    for key, value in sd.items():
        full = ref_sd[key]
        assert isinstance(value, DTensor), f"{where}: '{key}' is a {type(value).__name__}, not a DTensor"
        placement = placement_of(full)
        assert value.placements == (placement,), f"{where}: '{key}' placed {value.placements}, expected {placement}"
        assert value.shape == full.shape, f"{where}: '{key}' global shape {tuple(value.shape)}"
        local = full if isinstance(placement, Replicate) else local_chunk(full, placement.dim)
        assert torch.equal(value.to_local(), local), f"{where}: '{key}' local shard differs from the parameter"
    tied = [sd[key].to_local().untyped_storage().data_ptr() for key in ("lm_head.weight", "wte.weight")]
    assert tied[0] == tied[1], f"{where}: the tied weight came apart"


@scenario
def state_dict_sharded_without_communication():
    """Sharded DTensors, no collective, in every state of the step and for every layout."""
    cases = {
        "zero3": ({}, lambda p: Shard(0)),
        "no_reshard_after_forward": ({"reshard_after_forward": False}, lambda p: Shard(0)),
        "shard_last_dim": ({"shard_placement_fn": shard_last_dim}, lambda p: Shard(p.dim() - 1)),
        "no_shard": ({"strategy": "no_shard"}, lambda p: Replicate()),
        "zero2": ({"strategy": "optim_grads"}, lambda p: Shard(0)),
    }
    checked = []
    for label, (kwargs, placement_of) in cases.items():
        ref = build(0)
        model = shard_blocks_then_root(copy.deepcopy(ref), mesh=mesh_1d(), **kwargs)
        _check_state_dict(model, ref, placement_of, f"{label}, before any forward")
        loss = gpt_loss(model, local_batch(0))
        _check_state_dict(model, ref, placement_of, f"{label}, after forward (before backward)")
        loss.backward()
        _check_state_dict(model, ref, placement_of, f"{label}, after backward")
        with torch.no_grad():
            model(local_batch(1)[0])
        _check_state_dict(model, ref, placement_of, f"{label}, after a no_grad forward")
        checked.append(label)
    return checked


@scenario
def load_state_dict_sharded_dtensors():
    """load_state_dict takes another sharded model's state dict; the model then computes like the donor."""
    model, donor, donor_ref = sharded(0), sharded(1), build(1)
    result = model.load_state_dict(donor.state_dict())
    assert not result.missing_keys and not result.unexpected_keys, result
    assert_same(model.state_dict(), donor.state_dict())
    tokens = local_batch(0)[0]
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), donor_ref(tokens), rtol=0, atol=0)
    return sorted(model.state_dict())[:3]


@scenario
def load_state_dict_full_tensors():
    """Plain full tensors (e.g. from an unsharded model) in load_state_dict: each rank keeps its shard."""
    model, ref = sharded(0), build(1)
    model.load_state_dict(ref.state_dict())
    for key, value in model.state_dict().items():
        assert torch.equal(value.to_local(), local_chunk(ref.state_dict()[key], 0)), key


@scenario
def load_state_dict_local_shards_rejected():
    """Plain local shards are not a supported state dict: torch names the key and both shapes."""
    model = sharded(0)
    local = {key: value.to_local().clone() for key, value in model.state_dict().items()}
    return raises(
        lambda: model.load_state_dict(local), RuntimeError,
        "size mismatch for wte.weight", f"torch.Size([{local['wte.weight'].shape[0]}, 36])", "torch.Size([67, 36])",
    ).splitlines()[1]


@scenario
def set_model_state_dict_full_from_rank0():
    """The supported way to load a plain full state dict: rank 0 has it, the others get their shards."""
    model, ref = sharded(0), build(1)
    full = ref.state_dict() if dist.get_rank() == 0 else {}
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    for key, value in model.state_dict().items():
        assert torch.equal(value.to_local(), local_chunk(ref.state_dict()[key], 0)), key
    tokens = local_batch(0)[0]
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), ref(tokens), rtol=0, atol=0)


@scenario
def load_after_eval_forward_not_stale():
    """Loading new values after a forward that left the root unsharded: the next forward must use them.

    A no_grad forward keeps the root's unsharded parameters (it does not
    reshard after forward, and no backward comes); loading must make the next
    forward gather again.
    """
    tokens = local_batch(0)[0]
    donor_ref = build(1)
    with torch.no_grad():
        expected = donor_ref(tokens)
        # Through load_state_dict.
        model = sharded(0)
        model(tokens)
        model.load_state_dict(sharded(1).state_dict())
        diff_load = (model(tokens) - expected).abs().max().item()
        # Through DCP, which writes into the tensors state_dict() returned.
        model = sharded(0)
        model(tokens)
        path = ckpt_root() / "stale_probe"
        save_state_dict({"model": sharded(1).state_dict()}, step_dir(path, 1))
        load_state_dict({"model": model.state_dict()}, step_dir(path, 1))
        diff_dcp = (model(tokens) - expected).abs().max().item()
    assert diff_load == 0 and diff_dcp == 0, (
        f"stale parameters after loading: output differs by {diff_load} (load_state_dict) and {diff_dcp} (dcp.load)"
    )


@scenario
def load_after_eval_forward_with_reshard():
    """Explicit reshard() of every FSDP module before loading gives the same result."""
    tokens = local_batch(0)[0]
    with torch.no_grad():
        expected = build(1)(tokens)
        model = sharded(0)
        model(tokens)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
        model.load_state_dict(sharded(1).state_dict())
        torch.testing.assert_close(model(tokens), expected, rtol=0, atol=0)


# ---------------------------------------------------------------------- 2. get/set_state_dict
@scenario
def get_set_state_dict_roundtrip():
    """Model + AdamW through get_state_dict/set_state_dict into a fresh model; training continues identically."""
    model = sharded(0)
    optim = adamw(model)
    train(model, optim, range(2))
    state = train_state(model, optim)
    params = dict(model.named_parameters(remove_duplicate=False))
    for fqn, entry in state["optim"]["state"].items():
        param = params[fqn]
        for name in ("exp_avg", "exp_avg_sq"):
            value = entry[name]
            assert isinstance(value, DTensor), f"optimizer state {fqn}.{name} is a {type(value).__name__}"
            assert value.placements == param.placements and value.shape == param.shape, f"{fqn}.{name}"
            assert value.to_local().shape == param.to_local().shape, f"{fqn}.{name}: local shape"
    saved = clone_state(state)

    fresh = sharded(1)
    fresh_optim = adamw(fresh)
    train_state(fresh, fresh_optim)  # creates the optimizer state set_state_dict overwrites
    set_state_dict(fresh, fresh_optim, model_state_dict=saved["model"], optim_state_dict=saved["optim"])
    assert_same(train_state(fresh, fresh_optim), saved)
    losses, fresh_losses = train(model, optim, range(2, 4)), train(fresh, fresh_optim, range(2, 4))
    assert losses == fresh_losses, f"{losses} vs {fresh_losses}"
    assert_same(train_state(fresh, fresh_optim), train_state(model, optim))
    return losses


@scenario
def full_state_dict_on_rank0():
    """full_state_dict + cpu_offload: plain CPU tensors on rank 0 equal to the unsharded model; nothing elsewhere."""
    ref = build(0)
    model = shard_blocks_then_root(copy.deepcopy(ref), mesh=mesh_1d())
    optim = adamw(model)
    full = full_state(model, optim)
    if dist.get_rank() == 0:
        assert list(full["model"]) == list(ref.state_dict())
        for key, value in full["model"].items():
            assert type(value) is torch.Tensor and value.device.type == "cpu", f"{key}: {type(value).__name__}"
            assert torch.equal(value, ref.state_dict()[key]), key
    else:
        assert full == {"model": {}, "optim": {}}
    train(model, optim, range(2))
    full = full_state(model, optim)
    gathered = {name: param.full_tensor() for name, param in model.named_parameters(remove_duplicate=False)}
    sharded_optim = train_state(model, optim)["optim"]["state"]
    gathered_optim = {fqn: {k: v.full_tensor() for k, v in entry.items() if isinstance(v, DTensor)}
                      for fqn, entry in sharded_optim.items()}
    if dist.get_rank() == 0:
        for key, value in full["model"].items():
            assert type(value) is torch.Tensor and torch.equal(value, gathered[key]), key
        for fqn, entry in gathered_optim.items():
            for name, value in entry.items():
                plain = full["optim"]["state"][fqn][name]
                assert type(plain) is torch.Tensor and torch.equal(plain, value), f"{fqn}.{name}"


@scenario
def full_state_dict_on_every_rank():
    """fullshard's full_state_dict (as on MindSpore): every entry whole, as plain tensors, on every rank."""
    model = sharded(0)
    train(model, adamw(model), range(2))
    full = full_state_dict(model)
    assert list(full) == list(build(0).state_dict())
    for name, param in model.named_parameters(remove_duplicate=False):
        assert type(full[name]) is torch.Tensor and torch.equal(full[name], param.full_tensor()), name
    return len(full)


# ---------------------------------------------------------------------- 3. DCP save / reshard
@scenario
def dcp_save_world_size_2():
    """Train 2 steps, save model + AdamW at step 2; rank 0 writes the full state every later load must equal."""
    model = sharded(0)
    optim = adamw(model)
    train(model, optim, range(2))
    path = save_checkpoint(model, step_dir(ckpt_root() / "ws2", 2), optim)
    write_expected(model, optim, "expected_ws2.pt")
    assert latest_step(ckpt_root() / "ws2") == 2
    return sorted(p.name for p in path.iterdir())


@scenario(needs=[SAVED])
def dcp_load_world_size_2_shard_last_dim():
    """The Shard(0) checkpoint loads into Shard(dim-1) parameters (DCP reshards) bit for bit."""
    model = sharded(5, shard_placement_fn=shard_last_dim)
    optim = adamw(model)
    load_checkpoint(model, step_dir(ckpt_root() / "ws2", 2), optim)
    for name, param in model.named_parameters():
        assert param.placements == (Shard(param.dim() - 1),), name
    assert_matches_expected(model, optim, "expected_ws2.pt")


@scenario(needs=[SAVED])
def dcp_load_world_size_2_same_layout():
    model = sharded(5)
    optim = adamw(model)
    load_checkpoint(model, step_dir(ckpt_root() / "ws2", 2), optim)
    assert_matches_expected(model, optim, "expected_ws2.pt")


# ---------------------------------------------------------------------- 4. resume
@scenario
def resume_bit_exact():
    """4 steps straight == 2 steps, save, load into a fresh model + optimizer, 2 more steps (losses, params)."""
    model = sharded(0)
    optim = adamw(model)
    straight = train(model, optim, range(4))

    first = sharded(0)
    first_optim = adamw(first)
    before = train(first, first_optim, range(2))
    save_checkpoint(first, step_dir(ckpt_root() / "resume", 2), first_optim)
    del first, first_optim

    resumed = sharded(7)  # other initial values: everything must come from the checkpoint
    resumed_optim = adamw(resumed)
    load_checkpoint(resumed, step_dir(ckpt_root() / "resume", latest_step(ckpt_root() / "resume")), resumed_optim)
    after = train(resumed, resumed_optim, range(2, 4))
    assert before + after == straight, f"resumed losses {before + after} vs straight {straight}"
    assert_same(train_state(resumed, resumed_optim), train_state(model, optim))
    for (name, param), (_, ref) in zip(resumed.named_parameters(), model.named_parameters()):
        assert torch.equal(param.full_tensor(), ref.full_tensor()), name
    return straight


# ---------------------------------------------------------------------- 5. interop with torch FSDP2
@scenario(needs=[SAVED])
def interop_fullshard_to_torch_fsdp2():
    """The fullshard checkpoint loads into torch's fully_shard (same wrapping): identical state, identical shards."""
    model = torch_sharded(5)
    optim = adamw(model)
    load_checkpoint(model, step_dir(ckpt_root() / "ws2", 2), optim)
    assert_matches_expected(model, optim, "expected_ws2.pt")
    # Same placement, same chunking rule: the local shards are the ones fullshard holds.
    ours = sharded(6)
    ours_optim = adamw(ours)
    load_checkpoint(ours, step_dir(ckpt_root() / "ws2", 2), ours_optim)
    assert_same(train_state(ours, ours_optim), train_state(model, optim))


@scenario
def interop_torch_fsdp2_to_fullshard():
    """A checkpoint saved by torch's fully_shard with stock DCP loads into fullshard with identical state.

    It has no fullshard manifest: the load refuses it, naming the fix, until
    ``require_manifest=False`` says it is a stock checkpoint (every other check runs).
    """
    model = torch_sharded(3)
    optim = adamw(model)
    # Non-trivial optimizer state without a torch-FSDP2 backward: synthetic sharded gradients.
    gen = torch.Generator().manual_seed(100 + dist.get_rank())
    for param in model.parameters():
        local = torch.randn(param.to_local().shape, generator=gen)
        param.grad = DTensor.from_local(local, param.device_mesh, param.placements, shape=param.shape, stride=param.stride())
    optim.step()
    optim.zero_grad()
    path = ckpt_root() / "torch_fsdp2"
    dcp.save(train_state(model, optim), checkpoint_id=str(path))  # as a torch FSDP2 job saves
    write_expected(model, optim, "expected_torch_fsdp2.pt")

    ours = sharded(4)
    ours_optim = adamw(ours)
    refused = raises(lambda: load_checkpoint(ours, path, ours_optim), CheckpointError,
                     f"checkpoint {path}: has no fullshard.manifest.json", "pass require_manifest=False")
    load_checkpoint(ours, path, ours_optim, require_manifest=False)
    assert_matches_expected(ours, ours_optim, "expected_torch_fsdp2.pt")
    assert_same(train_state(ours, ours_optim), train_state(model, optim))
    # ...and it trains on from there.
    return {"refused": refused.split(": ", 2)[1], "losses": train(ours, ours_optim, range(1))}


# ---------------------------------------------------------------------- 6. checked loading
@scenario(needs=[SAVED])
def load_mismatch_fails_on_every_rank():
    """Wrong shapes, dtypes, missing or unexpected keys: a ValueError naming key and both sides, on every rank."""
    path = step_dir(ckpt_root() / "ws2", 2)
    wider = sharded(0, GPTConfig(vocab_size=67, seq_len=13, d_model=40, n_layers=2, n_heads=4))
    messages = [raises(
        lambda: load_state_dict({"model": wider.state_dict()}, path, strict=False), ValueError,
        "shape mismatch for 'model.wte.weight': checkpoint (67, 36) vs state (67, 40)",
    )]
    double = shard_blocks_then_root(build(0).double(), mesh=mesh_1d())
    messages.append(raises(
        lambda: load_state_dict({"model": double.state_dict()}, path, strict=False), ValueError,
        "dtype mismatch for 'model.wte.weight': checkpoint torch.float32 vs state torch.float64",
    ))
    model = sharded(5)
    messages.append(raises(
        lambda: load_state_dict({"model": model.state_dict()}, path), ValueError,
        "unexpected in checkpoint: 'optim' (", "entries, e.g. 'optim.param_groups.0.amsgrad'); pass strict=False",
    ))
    messages.append(raises(
        lambda: load_state_dict({"model": model.state_dict(), "extra": torch.zeros(2)}, path, strict=False),
        ValueError, "missing in checkpoint: 'extra' (state has tensor (2,) torch.float32)",
    ))
    # Nothing was half-done: the ranks are still in step and a good load works.
    optim = adamw(model)
    load_checkpoint(model, path, optim)
    assert_matches_expected(model, optim, "expected_ws2.pt")
    return [m.splitlines()[1].strip() for m in messages]


# ---------------------------------------------------------------------- 7. a save that fails on one rank
def _fails_on(rank: int, target: Any, attribute: str, replacement: Callable) -> contextlib.AbstractContextManager:
    """``target.attribute`` replaced on ``rank`` only (the other ranks' saves go as usual)."""
    return mock.patch.object(target, attribute, replacement) if dist.get_rank() == rank else contextlib.nullcontext()


def _failed_save_then_training_goes_on(name: str, fault: contextlib.AbstractContextManager, part: str, rank: int,
                                       cause: str, latest_after: int = 1) -> dict:
    """A save at step 2 under ``fault``: every rank raises RanksFailed naming the ``part`` of the save,
    ``rank`` and ``cause`` within seconds, and the latest complete checkpoint is then ``latest_after``; the
    ranks train another step (collectives still work) and save step 3, which loads."""
    root = ckpt_root() / f"failed_save_{name}"
    model = sharded(0)
    optim = adamw(model)
    train(model, optim, range(1))
    save_checkpoint(model, step_dir(root, 1), optim)
    train(model, optim, range(1, 2))
    began = time.monotonic()
    with fault:
        message = raises(lambda: save_checkpoint(model, step_dir(root, 2), optim), RanksFailed,
                         f"save_checkpoint: {part} ", f"failed on rank {rank}: {cause}", "the process group is still usable")
    took = time.monotonic() - began
    assert took < FAILED_SAVE_WITHIN_S, f"rank {dist.get_rank()} raised after {took:.1f}s"
    assert latest_step(root) == latest_after
    losses = train(model, optim, range(2, 3))
    save_checkpoint(model, step_dir(root, 3), optim)
    assert latest_step(root) == 3
    resumed = sharded(7)
    resumed_optim = adamw(resumed)
    load_checkpoint(resumed, step_dir(root, 3), resumed_optim)
    assert_same(train_state(resumed, resumed_optim), train_state(model, optim))
    return {"took_s": round(took, 4), "message": message, "losses": losses}


@scenario
def full_disk_on_rank_1_fails_the_save_on_every_rank():
    """Rank 1's disk fills up while DCP writes its shard file (rank 0 writes its own)."""
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    fault = _fails_on(1, dcp_filesystem, "_write_item", full)
    return _failed_save_then_training_goes_on("disk_full", fault, "writing the files of", 1,
                                              "OSError: [Errno 28] No space left on device")


@scenario
def read_only_directory_on_rank_1_fails_the_save_on_every_rank():
    """The checkpoint directory is read-only where rank 1 runs (another machine's mount of it): opening its
    shard file fails as a read-only mount fails it."""
    def read_only(self, path, mode):
        raise OSError(errno.EROFS, "Read-only file system", str(path))

    fault = _fails_on(1, dcp_filesystem.FileSystem, "create_stream", read_only)
    return _failed_save_then_training_goes_on("read_only", fault, "writing the files of", 1,
                                              "OSError: [Errno 30] Read-only file system")


@scenario
def read_only_directory_on_rank_0_fails_the_save_on_every_rank():
    """The checkpoint directory is read-only where rank 0 runs: it cannot even create the .partial, which
    it does alone before any rank writes."""
    def read_only(self, *args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", str(self))

    return _failed_save_then_training_goes_on("read_only_0", _fails_on(0, Path, "mkdir", read_only), "creating", 0,
                                              "OSError: [Errno 30] Read-only file system")


@scenario
def full_disk_while_writing_the_manifest_fails_the_save_on_every_rank():
    """The disk fills up as rank 0 writes the manifest (only rank 0 writes one, once every rank's files are
    complete)."""
    def full(path, data):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    fault = _fails_on(0, manifest, "write_file_durably", full)
    return _failed_save_then_training_goes_on("manifest", fault, "writing the manifest of", 0,
                                              "OSError: [Errno 28] No space left on device")


@scenario
def failed_publish_fails_the_save_on_every_rank():
    """Rank 0 cannot rename the complete .partial into place. Its manifest is written, so loaders take that
    .partial as step 2 (docs/checkpoints.md)."""
    real_replace = os.replace

    def busy(source, target):
        if str(source).endswith(".partial"):
            raise OSError(errno.EBUSY, "Device or resource busy", str(source))
        return real_replace(source, target)

    fault = _fails_on(0, publish.os, "replace", busy)
    return _failed_save_then_training_goes_on("publish", fault, "writing the manifest of", 0,
                                              "OSError: [Errno 16] Device or resource busy", latest_after=2)


# ---------------------------------------------------------------------- 8. another world size (4 ranks)
@scenario(world_sizes=(4,), needs=[(SAVED, 2)])
def load_world_size_2_at_4():
    """Saved at 2 ranks (Shard(0): 34 + 33 rows), loaded at 4 (17 * 3 + 16 rows): identical model and AdamW state."""
    model = sharded(5)
    optim = adamw(model)
    load_checkpoint(model, step_dir(ckpt_root() / "ws2", 2), optim)
    rows = model.wte.weight.to_local().shape[0]
    assert rows == (16 if dist.get_rank() == 3 else 17), f"rank {dist.get_rank()} holds {rows} rows of 67"
    assert_matches_expected(model, optim, "expected_ws2.pt")


@scenario(world_sizes=(4,), needs=[(SAVED, 2)])
def load_world_size_2_at_4_shard_last_dim():
    model = sharded(6, shard_placement_fn=shard_last_dim)
    optim = adamw(model)
    load_checkpoint(model, step_dir(ckpt_root() / "ws2", 2), optim)
    for name, param in model.named_parameters():
        assert param.placements == (Shard(param.dim() - 1),), name
    assert_matches_expected(model, optim, "expected_ws2.pt")


@scenario(world_sizes=(4,), needs=[(SAVED, 2)])
def save_world_size_4():
    """Train one more step at 4 ranks and save: the tests below load this one at world size 1."""
    model = sharded(5)
    optim = adamw(model)
    load_checkpoint(model, step_dir(ckpt_root() / "ws2", 2), optim)
    losses = train(model, optim, range(2, 3))
    save_checkpoint(model, step_dir(ckpt_root() / "ws4", 3), optim)
    write_expected(model, optim, "expected_ws4.pt")
    return {"losses": losses, "vocab": CFG.vocab_size}


# ---------------------------------------------------------------------- 9. world size 1 (this process), export
def _expected(root, name):
    return torch.load(root / name, weights_only=True)


@pytest.mark.parametrize("saved", [("ws2", 2, "expected_ws2.pt", SAVED, 2), ("ws4", 3, "expected_ws4.pt",
                                                                          "save_world_size_4", 4)], ids=["ws2", "ws4"])
def test_load_at_world_size_1(scenario_data, scenario_dir, saved):
    """A plain, unsharded GPT in this process (no process group) loads the sharded checkpoint exactly."""
    folder, step, expected_file, scenario_name, world_size = saved
    scenario_data(scenario_name, world_size)
    assert not dist.is_initialized()
    torch.manual_seed(9)
    model = GPT(CFG)
    load_checkpoint(model, step_dir(scenario_dir / folder, step))  # no optimizer: its entries are not read
    expected = _expected(scenario_dir, expected_file)["model"]
    for name, param in model.named_parameters(remove_duplicate=False):
        assert torch.equal(param, expected[name]), name
    assert not dist.is_initialized()


def test_load_full_state_dict_nested(scenario_data, scenario_dir):
    """load_full_state_dict rebuilds the saved nesting, optimizer state and param_groups included."""
    scenario_data(SAVED, 2)
    assert_same(load_full_state_dict(step_dir(scenario_dir / "ws2", 2)), _expected(scenario_dir, "expected_ws2.pt"))


def test_export_checkpoint_pt(scenario_data, scenario_dir, tmp_path):
    scenario_data(SAVED, 2)
    expected = _expected(scenario_dir, "expected_ws2.pt")
    path = step_dir(scenario_dir / "ws2", 2)
    everything = export_checkpoint(path, tmp_path / "full.pt", key=None)
    assert_same(torch.load(everything, weights_only=True), expected)
    model_file = export_checkpoint(path, tmp_path / "model.pt")  # the model, by default
    exported = torch.load(model_file, weights_only=True)
    assert_same(exported, expected["model"])
    model = GPT(CFG)
    model.load_state_dict(exported)  # a plain model takes it as is (strict)
    assert not dist.is_initialized(), "export must not start a process group"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full.pt", "model.pt"]  # no partial files left


def test_export_checkpoint_safetensors(scenario_data, scenario_dir, tmp_path):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    scenario_data(SAVED, 2)
    path = step_dir(scenario_dir / "ws2", 2)
    out = export_checkpoint(path, tmp_path / "model.safetensors")
    loaded = safetensors_torch.load_file(str(out))
    assert_same(loaded, _expected(scenario_dir, "expected_ws2.pt")["model"])
    with pytest.raises(ValueError, match="safetensors holds tensors only"):
        export_checkpoint(path, tmp_path / "all.safetensors", key=None)  # param_groups are not tensors


def test_export_checkpoint_rejects_unknown_format_and_key(scenario_data, scenario_dir, tmp_path):
    scenario_data(SAVED, 2)
    with pytest.raises(ValueError, match="unknown format"):
        export_checkpoint(step_dir(scenario_dir / "ws2", 2), tmp_path / "model.bin")
    with pytest.raises(ValueError, match="has no entry 'weights'; it has \\['model', 'optim'\\]"):
        export_checkpoint(step_dir(scenario_dir / "ws2", 2), tmp_path / "model.pt", key="weights")

