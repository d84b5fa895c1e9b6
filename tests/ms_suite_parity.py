"""Parity scenarios for fullshard.mindspore on 2 msrun workers, against a single-process reference."""
from __future__ import annotations

import fullshard.mindspore as fs
from tests.ms_parity import run_parity, wrap_layers


def zero3_default():
    return run_parity().as_dict()


def suite():
    return {
        "zero3_default": zero3_default,
    }
