"""The simulated Ascend host: ``import torch_npu`` here is the stand-in (``stand_in/``), imported before any test
module, as on a host where torch_npu is imported first. Run these tests in their own process:
``tools/ascend_host_check.sh`` (``PYTHONPATH=tests/ascend_host/stand_in python -m pytest -q tests/ascend_host``)."""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
if str(_HERE) not in sys.path:
    sys.path.insert(0, str(_HERE))

import sim  # noqa: E402

if not sim.stand_in_importable():
    raise RuntimeError("tests/ascend_host need the stand-in torch_npu first on the path: run tools/ascend_host_check.sh "
                       "(PYTHONPATH=tests/ascend_host/stand_in python -m pytest -q tests/ascend_host)")

import pytest  # noqa: E402
import torch_npu  # noqa: E402,F401  (renames PrivateUse1 to npu, registers the npu ops and the lazy torchair)


@pytest.fixture(scope="session")
def npu():
    """``torch.device("npu", 0)`` on the simulated host."""
    assert sim.is_simulated_host()
    return sim.device()
