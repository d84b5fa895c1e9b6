"""The main job, sharded training of a small GPT on text (``fullshard train``), and the launchers it, the
benchmark and the tests start ranks with (``procs``: processes and ports; ``msrun``: MindSpore's workers)."""
