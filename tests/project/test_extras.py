"""One framework per extra: fullshard.mindspore imports no torch, fullshard's torch API imports no MindSpore,
and ``pip install fullshard[mindspore]`` asks for no torch (nor ``fullshard[torch]`` for MindSpore)."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(code: str) -> None:
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_mindspore_runtime_imports_without_torch():
    pytest.importorskip("mindspore")
    # torch made unimportable: any import of it inside fullshard.mindspore fails loudly
    _run("import sys; sys.modules['torch'] = None\n"
         "import fullshard.mindspore as f\n"
         "assert callable(f.fully_shard) and f.HSDPModule is f.FSDPModule\n"
         "import fullshard.mindspore.api, fullshard.mindspore.accounting, fullshard.mindspore.checkpoint\n"
         "assert sys.modules['torch'] is None")


def test_torch_api_imports_without_mindspore():
    pytest.importorskip("torch")
    _run("import sys; sys.modules['mindspore'] = None\n"
         "from fullshard import fully_shard, MixedPrecisionPolicy\n"
         "import fullshard.torch.api\n"
         "assert sys.modules['mindspore'] is None")


def test_each_extra_brings_one_framework():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]

    def names(requirements):
        return {r.split("[")[0].split("<")[0].split(">")[0].split("=")[0].strip() for r in requirements}
    assert not names(project["dependencies"]) & {"torch", "mindspore"}
    assert "torch" in names(extras["torch"]) and "mindspore" not in names(extras["torch"])
    assert {"mindspore", "numpy"} <= names(extras["mindspore"]) and "torch" not in names(extras["mindspore"])
    assert "numpy<2" in extras["mindspore"]
    assert "safetensors" in names(extras["mindspore"])  # the MindSpore checkpoint reader
    pins = (ROOT / "constraints.txt").read_text().split()
    assert "mindspore==2.10.0" in pins and any(p.startswith("numpy==1.") for p in pins)
    assert "torch,mindspore," in (ROOT / "run").read_text()
