"""The PyTorch runtime: FSDP2's API over fullshard's plan (``from fullshard import fully_shard`` gives these)."""
