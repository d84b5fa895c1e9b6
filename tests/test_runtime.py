"""Issue 12 scenarios (tests/suite_runtime.py) on 2 gloo ranks."""
from tests.harness import suite_tests

results, test_scenario = suite_tests("tests.suite_runtime:suite", world_sizes=(2,))


def test_profiler_trace_names_fullshard_phases():
    """The labels reach a real torch.profiler trace (one process, world of one: no collective)."""
    import subprocess
    import sys

    from tests.harness import ROOT

    code = (
        "import os, torch, torch.distributed as dist\n"
        "os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=str(__import__('fullshard.train.procs', "
        "fromlist=['x']).free_port()), RANK='0', WORLD_SIZE='1')\n"
        "dist.init_process_group('gloo')\n"
        "from torch.distributed.device_mesh import init_device_mesh\n"
        "from fullshard import fully_shard\n"
        "model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))\n"
        "fully_shard(model[0], mesh=init_device_mesh('cpu', (1,))); fully_shard(model, mesh=init_device_mesh('cpu', (1,)))\n"
        "with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:\n"
        "    model(torch.randn(2, 4)).sum().backward()\n"
        "print(sorted({e.name for e in prof.events() if e.name.startswith('fullshard::')}))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert "fullshard::pre-forward all-gather (0)" in done.stdout, done.stdout + done.stderr
    assert "fullshard::post-backward reduce-scatter (0)" in done.stdout, done.stdout + done.stderr
