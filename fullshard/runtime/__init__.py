"""The PyTorch runtime: per-parameter state, communication groups, collectives and hooks."""
