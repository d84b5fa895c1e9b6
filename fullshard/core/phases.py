"""Where a sharded unit is in a training step: one enum instead of booleans that infer it.

Both runtimes move each unit through the same phases, and name the phase in
errors and profiler labels::

    IDLE -> PRE_FORWARD (gathering) -> FORWARD -> IDLE
         -> PRE_BACKWARD (gathered again, backward computing) -> POST_BACKWARD (reducing) -> IDLE

A unit used twice in one forward goes through PRE_BACKWARD / POST_BACKWARD
once per use; the root's end of backward returns every unit to IDLE.
"""
from __future__ import annotations

import enum


class TrainingPhase(enum.Enum):
    IDLE = "idle"
    PRE_FORWARD = "pre-forward"
    FORWARD = "forward"
    PRE_BACKWARD = "pre-backward"
    POST_BACKWARD = "post-backward"

    def __str__(self) -> str:
        return self.value
