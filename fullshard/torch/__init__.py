"""The PyTorch runtime: FSDP2's API over fullshard's plan (``from fullshard import fully_shard`` gives these),
and sharded checkpoints on DCP (``from fullshard import save_checkpoint, load_checkpoint``: ``checkpoint.py``)."""
