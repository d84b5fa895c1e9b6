"""The step machinery both runtimes share, framework-free: the unit and its gather state machine, the
``FSDPModule`` methods written once, owned and borrowed buffers with their meters, rank agreement and the
argument checks of ``fully_shard``, and the leaves of the structures modules pass."""
