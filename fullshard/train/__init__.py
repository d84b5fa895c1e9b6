"""The main job: sharded training of a small GPT on text (``fullshard train``)."""
