"""The few MindSpore internals the runtime depends on, in one place (MindSpore 2.10, PyNative).

* ``_no_grad`` keeps fullshard's own gathers and casts out of the graph that
  ``value_and_grad`` records (a gather issued while the graph is recorded,
  e.g. a prefetch, would otherwise be differentiated too);
* ``_pynative_executor.grad_flag()`` says whether a forward is being recorded
  for a gradient (inside ``ms.value_and_grad`` / ``ms.grad``);
* ``_pynative_executor.queue_backward_final_callback`` runs a function once,
  after the last gradient of the backward pass in flight, before
  ``value_and_grad`` returns. It may only be queued during that backward;
* ``_pynative_executor.clear_res()`` drops the graph a recorded forward left
  half-built when it raised: ``value_and_grad`` opens it and closes it only
  when the function returns, so without this the next ``value_and_grad``
  records inside the broken one and its backward fails (``LayerNormGrad``
  index errors, also without fullshard; ``tests/mindspore/test_facts.py``).

All four are private MindSpore API; a MindSpore upgrade that changes them
breaks here, and only here.
"""
from __future__ import annotations

from typing import Callable

import mindspore as ms
from mindspore.common.api import _pynative_executor


def no_grad():
    """A context in which MindSpore records nothing for autodiff."""
    return ms._no_grad()


def recording() -> bool:
    """Whether the forward running now is recorded for a gradient."""
    return bool(_pynative_executor.grad_flag()) and bool(_pynative_executor.enable_grad())


def queue_after_backward(callback: Callable[[], None]) -> None:
    """Run ``callback`` once the backward pass in flight has computed every gradient."""
    _pynative_executor.queue_backward_final_callback(callback)


def drop_failed_recording() -> None:
    """A recorded forward raised: forget what MindSpore recorded of it, so the next step records afresh."""
    _pynative_executor.clear_res()


def in_pynative_mode() -> bool:
    return ms.get_context("mode") == ms.PYNATIVE_MODE
