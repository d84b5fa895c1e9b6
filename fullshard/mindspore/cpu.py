"""The CPU's budget for one MindSpore worker: how many threads its ops and its launch pipeline use.

Measured here (MindSpore 2.10, PyNative, CPU; 3000 small matmul+add pairs in
one process): with the default launch pipeline, each op is handed from the
Python thread to a frontend and a backend queue thread, and the hand-offs cost
more than the ops: 10-12 s of wall and 5.7-6.6 s of CPU. With
``launch_blocking`` (ops launched on the calling thread) the same loop took
1.9-2.7 s and 0.8-1.0 s of CPU, and the two queue threads are gone. Two
workers on two cores then no longer compete with four spinning queue threads.
On a device (Ascend, GPU) the pipeline overlaps host and device work, so it
stays on there.
"""
from __future__ import annotations


def configure_cpu_worker(op_threads: int = 1, blocking_launch: bool = True) -> None:
    """Set this process's MindSpore CPU budget (call before the first op)."""
    import mindspore as ms

    ms.device_context.cpu.op_tuning.threads_num(op_threads)
    if blocking_launch:
        ms.runtime.launch_blocking()
