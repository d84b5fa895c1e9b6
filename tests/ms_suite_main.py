"""Every 2-worker MindSpore scenario that can share one msrun launch: parity, ownership, bad input (the
gradient matrix, ``tests.ms_suite_gradients``, has launches of its own).

GRAPH_MODE goes last (it switches the mode); the seed's bug raised inside a
bprop has a launch of its own (``tests.ms_suite_seed``).
"""
from tests import ms_suite_errors, ms_suite_ownership, ms_suite_parity


def suite():
    return {**ms_suite_parity.suite(), **ms_suite_ownership.suite(), **ms_suite_errors.suite()}
