"""The checkpoint formats fullshard writes itself, read as untrusted input.

- :mod:`~fullshard.checkpoint.formats.sharded_safetensors`: the MindSpore runtime's
  sharded format (MindSpore has no DCP): one safetensors file per rank, a
  JSON document of the entries, the manifest.
- :mod:`~fullshard.checkpoint.formats.safetensors_file`: one safetensors
  file, read through the ``safetensors`` package's own parser, bfloat16
  included (numpy has none).

The torch runtime's format is DCP's (``fullshard/torch/checkpoint.py``).
"""
