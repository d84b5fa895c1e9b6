"""Checkpoints, framework-free: what both runtimes' ``save_checkpoint`` / ``load_checkpoint`` / ``export_checkpoint``
share, and the step directories a training job keeps.

Both runtimes save a checkpoint the same way and read it as untrusted input
(docs/checkpoints.md); what does not depend on the framework lives here,
once:

- :mod:`~fullshard.checkpoint.publish`: the atomic save protocol (a
  ``.partial`` directory published by rename, found complete after a crash
  at any point) and a save that fails on one rank raising on every rank;
  the step directories (:func:`step_dir`, :func:`latest_step`,
  :func:`resolve`).
- :mod:`~fullshard.checkpoint.manifest`: the manifest (size and SHA-256 of
  every file, the completion marker) and canonical JSON.
- :mod:`~fullshard.checkpoint.files`: a checkpoint's files on disk, written
  durably and read without following a name or a symlink out of the directory.
- :mod:`~fullshard.checkpoint.untrusted`: :class:`CheckpointError`, the one
  error every reader raises, and the checks on what a checkpoint says
  (chunks, byte ranges, key paths, pickles).
- :mod:`~fullshard.checkpoint.formats`: the formats fullshard writes itself
  (MindSpore's sharded safetensors format; the safetensors file reader).

The framework code: ``fullshard/torch/checkpoint.py`` (on DCP) and
``fullshard/mindspore/checkpoint.py``. Importing this package imports no
framework (nor numpy).
"""
from fullshard.checkpoint.publish import RanksFailed, RecoveredCheckpointWarning, latest_step, resolve, step_dir
from fullshard.checkpoint.untrusted import CheckpointError

__all__ = ["CheckpointError", "RanksFailed", "RecoveredCheckpointWarning", "latest_step", "resolve", "step_dir"]
