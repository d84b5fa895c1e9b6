"""Time fullshard.mindspore's unpack of a fused all-gather output, one process, no collectives.

Each fused bucket of a small-GPT block (world size 2 by default) is unpacked the way
``fullshard.mindspore.buckets.unpack_member`` does it (a ``narrow`` view of each rank's
chunk, one ``mint.cat`` per member), next to slicing the flat output with an index
(``flat[a:b]``), which in PyNative copies the slice. The unsharded parameters cannot
be views of the output instead: a view keeps its data alive when the output is resized
to 0 (``RuntimeFacts.reclaims_views``), so ZeRO-3's free after forward would free nothing.

    .venv/bin/python benchmarks/mindspore_unpack.py [--world 2] [--repeats 200]

Each way runs twice, alternating, after a warm-up, and the second timing is reported
(the first grows MindSpore's memory pool).
"""
from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()

    import mindspore as ms
    from mindspore import Tensor, mint

    from fullshard.mindspore.buckets import unpack_member
    from fullshard.mindspore.cpu import configure_cpu_worker
    from fullshard.models.config import MODEL_SIZES
    from fullshard.models.gpt_mindspore import GPT
    from fullshard.plan import DEFAULT_FUSE_BELOW_NUMEL, ShardLayout, plan_buckets

    configure_cpu_worker()
    block = GPT(MODEL_SIZES["small"], seed=0).layers[0]
    layouts = [ShardLayout(tuple(p.shape), 0, args.world) for p in block.trainable_params()]
    for bucket in plan_buckets(layouts, fuse_below_numel=DEFAULT_FUSE_BELOW_NUMEL):
        if len(bucket.members) < 2:
            continue  # a lone parameter is gathered straight into its shape: nothing to unpack
        params = [SimpleNamespace(layout=layouts[i]) for i in bucket.members]
        flat = Tensor(np.random.default_rng(0).random(bucket.world * bucket.chunk_numel, dtype=np.float32))

        def narrow_and_cat():
            return [unpack_member(flat, bucket, j, p) for j, p in enumerate(params)]

        def index_slices():
            out = []
            for j, p in enumerate(params):
                layout = p.layout
                pieces = []
                for rank in range(bucket.world):
                    rows = layout.local_length(rank)
                    if rows:
                        start = rank * bucket.chunk_numel + bucket.offsets[j]
                        chunk = flat[start:start + layout.padded_chunk_numel].reshape(layout.padded_chunk_shape)
                        pieces.append(chunk[:rows])
                out.append(mint.cat(pieces, 0))
            return out

        timings = {}
        for way in (narrow_and_cat, index_slices) * 2:
            way()
            ms.runtime.synchronize()
            start = time.perf_counter()
            for _ in range(args.repeats):
                way()
            ms.runtime.synchronize()
            timings[way.__name__] = (time.perf_counter() - start) / args.repeats * 1e3
        shapes = ", ".join(str(p.layout.shape) for p in params)
        print(f"bucket of {len(params)} members ({shapes}), {bucket.world * bucket.chunk_numel * 4 / 1024:.0f} KiB: "
              + ", ".join(f"{name} {ms_:.2f} ms" for name, ms_ in timings.items()))


if __name__ == "__main__":
    main()
