"""The backend is found through the torch_dynamo_backends entry point, and only there."""

import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

import torch

from qwen_npu_compile.backend import qwen_npu_backend


def test_entry_point_declared():
    points = importlib.metadata.entry_points(group="torch_dynamo_backends")
    ours = [p for p in points if p.name == "qwen_npu"]
    assert len(ours) == 1
    assert ours[0].value == "qwen_npu_compile.backend:qwen_npu_backend"


def test_list_and_lookup():
    assert "qwen_npu" in torch._dynamo.list_backends()
    assert torch._dynamo.lookup_backend("qwen_npu") is qwen_npu_backend


def test_import_registers_nothing_and_never_imports_torch_npu():
    code = (
        "import sys, torch\n"
        "from torch._dynamo.backends import registry\n"
        "import qwen_npu_compile, qwen_npu_compile.backend, qwen_npu_compile.patterns\n"
        "assert 'qwen_npu' not in registry._COMPILER_FNS, 'registered at import time'\n"
        "assert 'torch_npu' not in sys.modules\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_patterns_is_a_subpackage_only(tmp_path):
    """The top-level ``patterns/`` folder installs as ``qwen_npu_compile.patterns`` only: nothing named plain
    ``patterns`` is installed by this project, whatever the checkout's folder is called. Checked in a fresh
    interpreter in isolated mode (``-I``: no current folder, no PYTHONPATH on sys.path) started in an empty folder,
    so that the checkout's own ``patterns/`` cannot be found through the current folder (as pytest's rootdir
    makes it here); a ``patterns`` found there must not come from this project (its checkout, or a file of
    its installed distribution)."""
    import qwen_npu_compile
    import qwen_npu_compile.patterns as patterns

    assert patterns.__name__ == "qwen_npu_compile.patterns"
    code = (
        "import importlib.util, json, qwen_npu_compile\n"
        "spec = importlib.util.find_spec('patterns')\n"
        "print(json.dumps([spec.origin if spec else None, qwen_npu_compile.__file__]))\n"
    )
    out = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    origin, installed = json.loads(out.stdout.strip().splitlines()[-1])
    if origin is None:
        return
    checkouts = {Path(qwen_npu_compile.__file__).resolve().parent.parent, Path(installed).resolve().parent.parent}
    assert not any(Path(origin).resolve().is_relative_to(root) for root in checkouts), origin
    files = importlib.metadata.distribution("qwen_npu_compile").files or []
    assert not any(f.parts and f.parts[0] == "patterns" for f in files), "the distribution installs patterns/"


def test_compile_by_name_fuses(npu_ops):
    def rms_norm(x, w):
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return w * h.to(x.dtype)

    x, w = torch.randn(2, 8, 32, dtype=torch.bfloat16), torch.randn(32, dtype=torch.bfloat16)
    out = torch.compile(rms_norm, backend="qwen_npu")(x, w)
    torch.testing.assert_close(out, rms_norm(x, w), atol=2e-2, rtol=2e-2)
    from qwen_npu_compile import get_reports

    assert [r.fusions for r in get_reports()] == [{"gated_delta_rule": 0, "rms_norm_gated": 0, "moe": 0, "rms_norm": 1, "swiglu": 0, "rotary": 0, "attention": 0}]
