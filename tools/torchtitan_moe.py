"""torchtitan's own DeepSeek-V3, expert parallel, wrapped by torchtitan's own parallelize code, trained on 4 gloo
ranks with fullshard (or stock FSDP2) and compared with one process holding the whole model (issue 30).

Setup (torchtitan is not a dependency of fullshard and is never installed by it; a separate venv):

    python3.11 -m venv .venv-torchtitan
    .venv-torchtitan/bin/pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
    .venv-torchtitan/bin/pip install torchtitan==0.3.0      # pulls spmd_types, datasets, ...

Run, from the repository root (the checkout's fullshard is imported through PYTHONPATH):

    TORCHDYNAMO_DISABLE=1 PYTHONPATH=. .venv-torchtitan/bin/python tools/torchtitan_moe.py            # both impls
    TORCHDYNAMO_DISABLE=1 PYTHONPATH=. .venv-torchtitan/bin/python tools/torchtitan_moe.py --impl torch
    ... tools/torchtitan_moe.py --reshard never --loss plain --idle-experts                     # variants

What it does, per ``--impl`` (``fullshard``, ``torch``; the default runs both, one after the other):

1. builds torchtitan's DeepSeek-V3 from torchtitan's own config builders, tiny: MLA (q_lora_rank > 0), a dense
   first layer, then MoE layers (top-2 softmax router with the load-balancing expert bias, 8 grouped experts,
   a shared expert), fp32 on CPU, torchtitan's initialisers from a fixed seed. Two configuration choices are
   forced by the CPU: the inner attention is torchtitan's ``ScaledDotProductAttention`` (FlexAttention has no
   backward on CPU), and torchtitan's ``ParallelDims`` builds its meshes on ``device_type = "cpu"``;
2. on 4 gloo ranks (spawned here), ``ParallelDims(dp_shard=4, ep=2)`` (so ``efsdp`` = 2) and torchtitan's
   ``parallelize_deepseekv3`` (``spmd_backend="partial_dtensor"``): EP of the grouped experts over ``ep``, then
   ``apply_fsdp_to_decoder``'s FSDP with a per-parameter mesh (``ShardPlacementResult`` from torch's private
   ``_get_mesh_info``), gradient divide factor 1.0 and explicit prefetching. torchtitan's files are not edited;
   for ``--impl fullshard`` the one change is the import switch: the names ``torchtitan.distributed.fsdp``
   imported from torch (``fully_shard``, ``FSDPModule``, ``MixedPrecisionPolicy``, ``CPUOffloadPolicy``) are
   rebound to fullshard's. Stock FSDP2 on gloo additionally needs ``set_force_sum_reduction_for_comms(True)``
   (gloo has no ``PREMUL_SUM``; with factor 1.0 the result is the same);
3. trains ``--steps`` steps as torchtitan's trainer does: a fixed batch per rank (some labels ignored, a
   different count per rank), the global valid-token count summed over the ``batch`` mesh, torchtitan's loss
   (``ChunkedLossWrapper`` around ``CrossEntropyLoss``, as torchtitan's DeepSeek-V3 configs use; ``--loss plain``
   for plain cross-entropy), torchtitan's EP-aware ``clip_grad_norm_``, its AdamW ``OptimizersContainer`` and the
   MoE load-balancing hook. Rank 0 also steps the reference on the union of the ranks' batches. Compared each
   step: the global loss, the clipped gradient norm and every gradient (``full_tensor()``); at the end every
   parameter and the experts' load-balancing bias. AdamW hides a uniform scale error in the gradients, which is
   why the gradients themselves are compared;
4. records every collective that reaches c10d (a ``TorchDispatchMode``: the ops of ``torch.distributed`` and
   of its functional collectives) with the global ranks of its process group, and asserts for fullshard that
   the experts gather and reduce on the ``efsdp`` groups, everything else on the ``fsdp`` group, and that the
   EP all-to-alls ran on the ``ep`` groups.

Tolerances: torchtitan's ``GroupedExperts`` computes in bfloat16 (``x.bfloat16()``, ``w.bfloat16()``), so an
expert weight's gradient is a bf16 sum over this rank's tokens, not over all of them, and the reference differs
there by bf16 rounding (relative ~1e-2 on the smallest elements, absolute ~1e-7). Everything else is fp32. AdamW
moves every parameter by about lr whatever the size of its gradient, so an element whose tiny gradient's sign
bf16 decides ends up to lr per step away: under AdamW the final parameters are checked to lr x steps, under
``--optimizer sgd`` to 1e-5; the gradients are checked every step to 1e-6 either way. The two sharded runs share
every local computation, and are compared with each other (fullshard vs FSDP2) to 1e-6. The exit status is
non-zero on any mismatch.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import socket
import sys
import tempfile
from collections import Counter

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

WORLD, EP, SEQ, ROWS_PER_RANK, VOCAB, DIM = 4, 2, 16, 2, 64, 32
N_LAYERS, N_DENSE, N_EXPERTS, TOP_K = 3, 1, 8, 2
IGNORE = -100


# ---------------------------------------------------------------------------------------------- the model
def model_config(idle_experts: bool):
    """torchtitan's DeepSeek-V3 config builders at toy sizes (their 16B flavour's structure, q_lora as 236B/671B)."""
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.deepseek_v3 import (_EMBEDDING_INIT, _NORM_INIT, _build_dsv3_layers,
                                               _output_linear_init)
    from torchtitan.models.deepseek_v3.model import DeepSeekV3Model
    from torchtitan.models.deepseek_v3.sharding import set_deepseek_v3_sharding_config

    rope_dim = 4
    layers = _build_dsv3_layers(
        n_layers=N_LAYERS, n_dense_layers=N_DENSE, dim=DIM, n_heads=2, q_lora_rank=16, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=rope_dim, v_head_dim=8, mscale=0.7, dense_hidden_dim=48,
        moe_hidden_dim=16, num_experts=N_EXPERTS, num_shared_experts=1, router_top_k=TOP_K,
        router_score_func="softmax", attn_backend="flex", moe_comm_backend="standard",
        non_blocking_capacity_factor=None,
        rope=ComplexRoPE.Config(dim=rope_dim, max_seq_len=4 * SEQ, theta=10000.0, scaling="yarn", rope_factor=40.0,
                                beta_fast=32.0, beta_slow=1.0, original_seq_len=SEQ))
    for layer in layers:  # FlexAttention has no backward on CPU
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    config = DeepSeekV3Model.Config(
        vocab_size=VOCAB, dim=DIM,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=_output_linear_init(DIM)),
        layers=layers, mtp_layers=[])
    set_deepseek_v3_sharding_config(config, enable_sp=False, enable_ep=True)
    return config


def build_model(args):
    torch.manual_seed(args.seed)
    model = model_config(args.idle_experts).build()
    with torch.no_grad():
        model.init_weights(buffer_device=None)
        if args.idle_experts:  # the second ep rank's experts get no token from anyone: zero-token grouped_mm
            for block in model.layers.values():
                if block.moe_enabled:
                    block.moe.expert_bias_E[N_EXPERTS // EP:] = -1e4
    return model


def global_batch(seed: int):
    """A fixed batch per rank; ignored labels, a different number on each rank (the global count matters)."""
    gen = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(0, VOCAB, (WORLD * ROWS_PER_RANK, SEQ + 1), generator=gen)
    inputs, labels = tokens[:, :-1].clone(), tokens[:, 1:].clone()
    for rank in range(WORLD):
        labels[rank * ROWS_PER_RANK, : 2 * rank] = IGNORE
    return inputs, labels


# ---------------------------------------------------------------------------------------------- recording
class Collectives(TorchDispatchMode):
    """Every c10d collective (``torch.distributed``'s and the functional ones), by op and its group's ranks."""

    KINDS = {"allgather": "all_gather", "reduce_scatter": "reduce_scatter", "allreduce": "all_reduce",
             "all_reduce": "all_reduce", "all_to_all": "all_to_all", "alltoall": "all_to_all",
             "all_gather": "all_gather", "send": "send/recv", "recv": "send/recv", "broadcast": "broadcast"}

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter = Counter()  # (kind, ranks) of c10d ops
        self.fullshard: Counter = Counter()  # (kind, ranks) of fullshard's own collectives, whatever carries them
        self._originals: dict = {}

    def __enter__(self):
        if "fullshard.torch.collectives" in sys.modules:  # fullshard on gloo exchanges pairwise: send/recv
            from fullshard.torch import collectives
            for name in ("all_gather", "reduce_scatter", "all_reduce_sum"):
                original = self._originals[name] = getattr(collectives, name)
                setattr(collectives, name, self._wrapping(name, original))
        return super().__enter__()

    def __exit__(self, *exc):
        from fullshard.torch import collectives
        for name, original in self._originals.items():
            setattr(collectives, name, original)
        self._originals.clear()
        return super().__exit__(*exc)

    def _wrapping(self, name, original):
        def record(exchange, *args, **kwargs):
            group = kwargs.get("group", args[2] if name != "all_reduce_sum" else args[1])
            self.fullshard[(name, tuple(dist.get_process_group_ranks(group)))] += 1
            return original(exchange, *args, **kwargs)
        return record

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        namespace = func.namespace
        if namespace in ("c10d", "_c10d_functional"):
            self._record(func.__name__.split(".")[0], args, kwargs or {})
        return func(*args, **(kwargs or {}))

    def _record(self, name, args, kwargs) -> None:
        kind = next((k for key, k in self.KINDS.items() if key in name), None)
        if kind is None:  # wait_tensor, barrier...
            return
        # a c10d op takes the ProcessGroup (boxed), a functional one its registered name (the last str argument)
        boxed = [a for a in (*args, *kwargs.values())
                 if isinstance(a, torch.ScriptObject) and a._type().qualified_name().endswith("c10d.ProcessGroup")]
        names = [a for a in (*args, *kwargs.values()) if isinstance(a, str)]
        group = dist.ProcessGroup.unbox(boxed[0]) if boxed else dist.distributed_c10d._resolve_process_group(names[-1])
        self.calls[(kind, tuple(dist.get_process_group_ranks(group)))] += 1


# ---------------------------------------------------------------------------------------------- one rank
def switch_imports() -> None:
    """The import switch: what torchtitan's FSDP module imported from torch, rebound to fullshard's names."""
    import fullshard
    import torchtitan.distributed.fsdp as titan_fsdp
    for name in ("fully_shard", "FSDPModule", "MixedPrecisionPolicy", "CPUOffloadPolicy"):
        setattr(titan_fsdp, name, getattr(fullshard, name))


def parallelize(model, args, impl: str):
    """torchtitan's ParallelDims on CPU and its DeepSeek-V3 parallelize entry point, unchanged."""
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.models.deepseek_v3 import parallelize_deepseekv3

    parallel_dims_module.device_type = "cpu"  # its meshes' device; torchtitan picks "cuda" without an accelerator
    parallelism = ParallelismConfig(data_parallel_shard_degree=WORLD, expert_parallel_degree=EP,
                                    spmd_backend="partial_dtensor", fsdp_reshard_after_forward=args.reshard)
    dims = ParallelDims.from_config(parallelism, WORLD)
    dims.build_mesh()
    training = TrainingConfig(mixed_precision_param="float32", mixed_precision_reduce="float32")
    model = parallelize_deepseekv3(model, parallel_dims=dims, training=training, parallelism=parallelism,
                                   compile_config=CompileConfig(enable=False), ac_config=None,
                                   dump_folder=tempfile.gettempdir())
    if impl == "torch":  # gloo has no PREMUL_SUM, which FSDP2 uses for a divide factor of 1.0
        from torch.distributed.fsdp import FSDPModule
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
    return model, dims


class Trainer:
    """The pieces of torchtitan's trainer a step needs: its loss, clipping, optimizer and MoE balancing hook."""

    def __init__(self, model, args, dims) -> None:
        from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
        from torchtitan.components.optimizer import default_adamw, register_moe_load_balancing_hook

        self.model, self.dims, self.max_norm = model, dims, args.max_norm
        if args.loss == "chunked":
            self.loss_fn = ChunkedLossWrapper.Config(num_chunks=4).build()
            self.loss_fn.set_lm_head(model.lm_head)
            model._skip_lm_head = True
        else:
            self.loss_fn = CrossEntropyLoss.Config().build()
        if args.optimizer == "adamw":  # torchtitan's default
            self.optimizers = default_adamw(lr=args.lr).build(model_parts=[model])
        else:  # torchtitan's container has no SGD; torch's takes the same step pre-hook
            self.optimizers = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
        register_moe_load_balancing_hook(self.optimizers, [model], dims)

    def forward_backward(self, inputs, labels) -> tuple[torch.Tensor, torch.Tensor]:
        from torchtitan.distributed import utils as dist_utils
        local_valid = (labels != IGNORE).sum()
        mesh = self.dims.get_optional_mesh("batch")
        global_valid = dist_utils.dist_sum_tensor(local_valid, mesh) if mesh is not None else local_valid
        loss, _ = self.loss_fn(self.model(inputs), labels, global_valid)
        loss.backward()  # local sum / global valid tokens: the sum over ranks is the global mean
        norm = dist_utils.clip_grad_norm_([p for p in self.model.parameters()], self.max_norm, foreach=True,
                                          pp_mesh=None, ep_enabled=self.dims.ep_enabled)
        return loss.detach(), norm.detach()

    def step(self) -> None:
        self.optimizers.step()
        self.optimizers.zero_grad()


class SingleProcess:
    """What ParallelDims answers for one process: no mesh, nothing to reduce."""

    ep_enabled, tp = False, 1

    def get_optional_mesh(self, name):
        return None


def full(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def compare(named_tensors, reference: dict, diffs: dict, what: str) -> None:
    """Gathers every tensor (all ranks), then rank 0 keeps the largest |difference| per category."""
    for name, tensor in named_tensors:
        whole = full(tensor).detach()
        if dist.get_rank() != 0:
            continue
        diff = (whole - reference[name]).abs().max().item()
        key = what if what == "expert bias" else f"{what} {'experts' if 'inner_experts' in name else 'dense'}"
        diffs[key] = max(diffs.get(key, 0.0), diff)
        scale = reference[name].abs().max().item()
        diffs[key + " (rel)"] = max(diffs.get(key + " (rel)", 0.0), diff / scale if scale else 0.0)


def run_rank(rank: int, impl: str, args, port: int, out_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    from torchtitan.distributed import utils as dist_utils
    dist_utils.set_spmd_backend("partial_dtensor")
    if impl == "fullshard":
        switch_imports()
    model = build_model(args)
    reference = copy.deepcopy(model) if rank == 0 else None
    model, dims = parallelize(model, args, impl)
    trainer = Trainer(model, args, dims)
    ref_trainer = Trainer(reference, args, SingleProcess()) if rank == 0 else None
    inputs, labels = global_batch(args.seed)
    mine = slice(rank * ROWS_PER_RANK, (rank + 1) * ROWS_PER_RANK)
    recorder, result = Collectives(), {"losses": [], "ref_losses": [], "norms": [], "ref_norms": [], "diffs": {}}
    for _ in range(args.steps):
        with recorder:
            loss, norm = trainer.forward_backward(inputs[mine], labels[mine])
        dist.all_reduce(loss)  # the loss mesh: every rank here
        result["losses"].append(loss.item())
        result["norms"].append(norm.item())
        ref_grads = {}
        if rank == 0:
            ref_loss, ref_norm = ref_trainer.forward_backward(inputs, labels)
            result["ref_losses"].append(ref_loss.item())
            result["ref_norms"].append(ref_norm.item())
            ref_grads = {n: p.grad.detach().clone() for n, p in reference.named_parameters()}
        compare(((n, p.grad) for n, p in model.named_parameters()), ref_grads, result["diffs"], "grad")
        with recorder:
            trainer.step()
        if rank == 0:
            ref_trainer.step()
    finals = {n: p.detach() for n, p in reference.named_parameters()} if rank == 0 else {}
    compare(model.named_parameters(), finals, result["diffs"], "param")
    bias = {n: b for n, b in reference.named_buffers() if n.endswith("expert_bias_E")} if rank == 0 else {}
    compare(((n, b) for n, b in model.named_buffers() if n.endswith("expert_bias_E")), bias, result["diffs"], "expert bias")
    result["collectives"] = {f"{kind} {list(ranks)}": n for (kind, ranks), n in sorted(recorder.calls.items())}
    result["collectives"].update({f"fullshard.{kind} {list(ranks)}": n
                                  for (kind, ranks), n in sorted(recorder.fullshard.items())})
    result["checks"], result["wrong"] = check_mechanism(model, dims, recorder, args, impl)
    params = {n: full(p).detach() for n, p in model.named_parameters()}
    if rank == 0:
        torch.save(params, out_path + ".params")
    counts = [None] * WORLD
    dist.all_gather_object(counts, result["collectives"])
    result["collectives_per_rank"] = counts
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------- mechanism
def check_mechanism(model, dims, recorder: Collectives, args, impl: str) -> tuple[list[str], list[str]]:
    """Which process group every gather and reduction ran on: (what was found, what is wrong). Asserted for
    fullshard, whose units and collectives are known here; for FSDP2 the table shows its c10d calls."""
    fsdp, efsdp, ep = (tuple(dist.get_process_group_ranks(dims.get_mesh(name).get_group()))
                       for name in ("fsdp", "efsdp", "ep"))
    a2a = {ranks: n for (kind, ranks), n in recorder.calls.items() if kind == "all_to_all"}
    moe_blocks = [b for b in model.layers.values() if b.moe_enabled]
    found, wrong = [f"meshes: fsdp {list(fsdp)}, efsdp {list(efsdp)}, ep {list(ep)}"], []
    # per MoE layer and step: token counts, tokens out, tokens back in forward; the two token exchanges in backward
    if set(a2a) != {ep} or a2a[ep] != 5 * len(moe_blocks) * args.steps:
        wrong.append(f"all-to-all: {a2a}, expected {5 * len(moe_blocks) * args.steps} on {list(ep)}")
    if impl != "fullshard":
        return found, wrong
    by = lambda kind: {ranks: n for (k, ranks), n in recorder.fullshard.items() if k == kind}  # noqa: E731
    gathers, reduces = by("all_gather"), by("reduce_scatter")
    for block in moe_blocks:
        groups = block._fullshard_unit.groups
        ranks = [tuple(dist.get_process_group_ranks(g.process_group)) for g in groups]
        names = sorted(p.fqn.rpartition(".")[2] for p in groups[-1].params)
        if ranks != [fsdp, efsdp] or names != ["w1_EFD", "w2_EDF", "w3_EFD"]:
            wrong.append(f"a MoE block's groups are on {ranks}, its expert group holds {names}")
    buckets = sum(len(b._fullshard_unit.groups[-1].plan.buckets) for b in moe_blocks)
    passes = 1 if args.reshard == "never" else 2  # gathered in forward, and again in backward unless kept
    if gathers.get(efsdp) != passes * buckets * args.steps or reduces.get(efsdp) != buckets * args.steps:
        wrong.append(f"experts: {buckets} buckets, gathered {gathers.get(efsdp)}x, reduced {reduces.get(efsdp)}x")
    if not set(gathers) == set(reduces) == {fsdp, efsdp}:
        wrong.append(f"gathers on {sorted(gathers)}, reductions on {sorted(reduces)}")
    found.append(f"experts: {buckets} bucket(s) in {len(moe_blocks)} MoE blocks, gathered {gathers.get(efsdp)}x, "
                 f"reduced {reduces.get(efsdp)}x on efsdp; dense: gathered {gathers.get(fsdp)}x, reduced "
                 f"{reduces.get(fsdp)}x on fsdp; all-to-all {a2a.get(ep)}x on ep")
    return found, wrong


# ---------------------------------------------------------------------------------------------- driver
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(impl: str, args, workdir: str) -> dict:
    out_path = os.path.join(workdir, f"{impl}.json")
    mp.start_processes(run_rank, args=(impl, args, free_port(), out_path), nprocs=WORLD, start_method="spawn")
    with open(out_path) as f:
        result = json.load(f)
    result["params"] = torch.load(out_path + ".params")
    return result


def tolerances(args) -> dict:
    """Absolute. The gradients are exact up to fp32 and the experts' bf16 matmuls (see the docstring). AdamW moves
    a parameter by about lr whatever its gradient's size, so a gradient element near zero, whose sign bf16
    rounding decides, moves either way: under AdamW the final parameters agree to lr per step, under SGD (whose
    step is lr x gradient) tightly."""
    params = args.lr * args.steps if args.optimizer == "adamw" else 1e-5
    return {"loss": 1e-5, "norm": 1e-5, "grad dense": 1e-6, "grad experts": 1e-6, "param dense": params,
            "param experts": params, "expert bias": 0.0, "fullshard vs torch": 1e-6}


def report(results: dict, args) -> list[str]:
    failures, tol_of = [], tolerances(args)
    print(f"\n{'impl':10} {'what':24} {'max |diff| vs one process':>26} {'tolerance':>10}")
    for impl, result in results.items():
        rows = {"loss": max(abs(a - b) for a, b in zip(result["losses"], result["ref_losses"])),
                "norm": max(abs(a - b) for a, b in zip(result["norms"], result["ref_norms"]))}
        rows.update(result["diffs"])
        for what, diff in rows.items():
            tol = tol_of.get(what)
            bad = tol is not None and not diff <= tol
            failures += [f"{impl}: {what} differs by {diff:.3g} (> {tol})"] if bad else []
            print(f"{impl:10} {what:24} {diff:26.3e} {'' if tol is None else f'{tol:10.0e}'}{'  FAIL' if bad else ''}")
        print(f"{impl:10} losses    {' '.join(f'{x:.6f}' for x in result['losses'])}")
        print(f"{'':10} reference {' '.join(f'{x:.6f}' for x in result['ref_losses'])}")
        for line in result["checks"]:
            print(f"{impl:10} {line}")
        failures += [f"{impl} (rank 0): {line}" for line in result["wrong"]]
        for rank, counts in enumerate(result["collectives_per_rank"]):
            print(f"{impl:10} rank {rank}: " + ", ".join(f"{k}: {n}" for k, n in counts.items()))
    if len(results) == 2:
        a, b = results["fullshard"]["params"], results["torch"]["params"]
        diff = max((a[n] - b[n]).abs().max().item() for n in a)
        loss = max(abs(x - y) for x, y in zip(results["fullshard"]["losses"], results["torch"]["losses"]))
        print(f"fullshard vs torch FSDP2: losses {loss:.3e}, final parameters {diff:.3e}")
        if not max(diff, loss) <= tol_of["fullshard vs torch"]:
            failures.append(f"fullshard vs torch differ by {max(diff, loss):.3g}")
    return failures


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--impl", choices=("fullshard", "torch", "both"), default="both")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    parser.add_argument("--lr", type=float, default=None, help="8e-4 for AdamW (torchtitan's), 0.1 for SGD")
    parser.add_argument("--max-norm", type=float, default=1.0)
    parser.add_argument("--reshard", choices=("default", "always", "never"), default="default",
                        help="torchtitan's fsdp_reshard_after_forward policy")
    parser.add_argument("--loss", choices=("chunked", "plain"), default="chunked")
    parser.add_argument("--idle-experts", action="store_true",
                        help="the expert bias keeps every token from the second ep rank's experts")
    args = parser.parse_args(argv)
    args.lr = args.lr if args.lr is not None else (8e-4 if args.optimizer == "adamw" else 0.1)
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    impls = ("fullshard", "torch") if args.impl == "both" else (args.impl,)
    with tempfile.TemporaryDirectory() as workdir:
        results = {impl: run(impl, args, workdir) for impl in impls}
    failures = report(results, args)
    for failure in failures:
        print("MISMATCH:", failure)
    print("OK" if not failures else f"FAILED ({len(failures)})")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
