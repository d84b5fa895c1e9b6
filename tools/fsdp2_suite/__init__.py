"""Run PyTorch's own FSDP2 test files on CPU/gloo, with stock FSDP2 or with fullshard.

    python tools/fsdp2_suite --impl torch                      # the baseline
    python tools/fsdp2_suite --impl fullshard                  # the drop-in claim
    python tools/fsdp2_suite --impl fullshard test_fully_shard_init.py -k lazy_init
    python tools/fsdp2_suite --compare RESULTS_TORCH.json RESULTS_FULLSHARD.json

The upstream test files are not part of this repository (never commit them):
``--upstream`` (default ``.fsdp2-suite/upstream``, ignored by git) holds copies
of ``test/distributed/_composable/fsdp/*.py`` whose versions import against the
installed torch's ``torch.testing._internal``; docs/fsdp2-compatibility.md lists
the ones used. ``--deps`` may hold packages the upstream files need that the
project's venv lacks (``expecttest``), installed with ``pip install --target``.

How it works
------------
Each file runs in its own pytest process, one file at a time (``driver``).
Every Python process of a run, the pytest process and each rank FSDPTest
spawns, starts through a generated ``sitecustomize.py`` that calls
:func:`fsdp2_suite.bootstrap.bootstrap` when ``FSDP2_SUITE_IMPL`` is set; the
driver puts the folder above this package on every process's ``PYTHONPATH``.
``bootstrap``:

* ``--impl fullshard``: imports fullshard first (it subclasses torch's
  ``FSDPModule``/``UnshardHandle`` and keeps torch's classes from import
  time, so the swap cannot reach them), then puts fullshard's seven public names into ``torch.distributed.fsdp``,
  ``torch.distributed.fsdp._fully_shard`` and ``torch.distributed._composable.fsdp``
  (+ its ``fully_shard`` module) before any test module imports them.
  torch's private modules (``_fsdp_api``, ``_fully_shard._fully_shard``, ...)
  are left alone, so torch's own code built on them keeps working.
* CPU: ``skip_if_lt_x_gpu(x)`` (and ``requires_world_size`` /
  ``at_least_x_gpu``) only count accelerators; they let the test through when
  x <= ``--max-ranks`` CPU processes and record x on the test. ``world_size``
  properties of the test classes are evaluated as on a machine with
  max(x, ``--vgpus``) accelerators (only the device-count queries are
  answered differently, and only while the property runs). ``FSDPTest._run``
  and ``FSDPTestContinuous._init_pg`` no longer exit with "multi-gpu-N" when
  there is no accelerator; they init gloo. Tests that are really CUDA-only
  (``skipIf(not TEST_CUDA)``, ``requires_nccl``, ...) stay skipped.
* Reference models: ``DistributedDataParallel(device_ids=[rank])`` on CPU
  modules drops ``device_ids`` (it means "this rank's GPU"; DDP refuses it on CPU).
* ``common_utils.HardwareClassification`` (a test-selection label of newer
  torch) is defined when missing, so newer upstream files that only use it as a
  class attribute import.
* ``MultiProcContinuousTest`` classes skip every later test once one failed
  ("Previous test failed"); the driver reruns such tests one per process.

Each test runs under a timeout (SIGALRM in the pytest process, plus
FSDPTest's own ``DISTRIBUTED_TESTS_DEFAULT_TIMEOUT``); a file's pytest process
is also killed when it exceeds its own budget, and the driver then records
the running test as a timeout and resumes the file with the tests not run yet.

Results: ``<out>/<impl>.json`` (one record per test: file, test, outcome
pass/fail/error/skip/timeout, reason, where, details) and a per-file table on
stdout. ``--compare`` lists the tests that pass with torch and not with
fullshard.

The parts: ``__main__`` (arguments), ``driver`` (pytest processes, timeouts,
resuming), ``bootstrap`` (the sitecustomize and the patches in every process),
``plugin`` (the pytest hooks that record events), ``results`` (classifying
failures, the table, ``--compare``, ``--merge``). This module holds only the
environment variables through which the driver talks to the processes it starts.
"""

ENV_IMPL = "FSDP2_SUITE_IMPL"
ENV_VGPUS = "FSDP2_SUITE_VGPUS"
ENV_MAX_RANKS = "FSDP2_SUITE_MAX_RANKS"
ENV_RESULTS = "FSDP2_SUITE_RESULTS"
ENV_TIMEOUT = "FSDP2_SUITE_TEST_TIMEOUT"
