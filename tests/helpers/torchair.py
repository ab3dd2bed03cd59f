"""The torch_npu wheel's torchair off-NPU: its sources, and a GE conversion script run in a fresh interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from . import REPO


def torchair_wheel_sources():
    """The torch_npu wheel's sources for this torch (``torchair.offline.wheel.obtain_sources``), or skip the test."""
    from qwen_npu_compile.torchair.offline import wheel

    try:
        return wheel.obtain_sources(torch.__version__)
    except wheel.TorchairUnavailableError as exc:
        pytest.skip(f"no torch_npu wheel: {exc}")


def run_ge_script(script: str, tmp_path) -> list:
    """Run ``script`` (``python -c``; argv: the dump folder ``tmp_path``) in a fresh interpreter, as importing
    torchair patches torch for the whole process; the repository root is on ``PYTHONPATH``, so the script imports
    ``tests.helpers``. Skipped without the torch_npu wheel. Returns the JSON list the script printed on its last
    line."""
    torchair_wheel_sources()
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
