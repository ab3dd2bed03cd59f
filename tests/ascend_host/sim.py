"""Helpers for the simulated Ascend host's tests (tests/ascend_host; see README.md there).

The stand-in ``torch_npu`` lives in ``stand_in/``; ``tools/ascend_host_check.sh`` puts it on ``PYTHONPATH`` and
runs these tests in a pytest process of their own (the PrivateUse1 rename is process-global and irreversible).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
STAND_IN = HERE / "stand_in"
REPO = HERE.parents[1]
DEVICE_NAME = "npu"
DEVICE = torch.device(DEVICE_NAME, 0) if torch._C._get_privateuse1_backend_name() == DEVICE_NAME else None


def is_simulated_host() -> bool:
    """True when the stand-in ``torch_npu`` is the one imported in this process (PrivateUse1 is ``npu``)."""
    module = sys.modules.get("torch_npu")
    return bool(getattr(module, "SIMULATED", False)) and torch._C._get_privateuse1_backend_name() == DEVICE_NAME


def stand_in_importable() -> bool:
    """True when ``import torch_npu`` would find the stand-in (without importing it)."""
    import importlib.util

    spec = importlib.util.find_spec("torch_npu") if "torch_npu" not in sys.modules else sys.modules["torch_npu"].__spec__
    return spec is not None and spec.origin is not None and Path(spec.origin).resolve().is_relative_to(STAND_IN)


def device():
    """``torch.device("npu", 0)``."""
    return torch.device(DEVICE_NAME, 0)


def subprocess_env(**extra: str) -> dict:
    """``os.environ`` for a child process on the simulated host: the stand-in and the repository first on
    ``PYTHONPATH``, plus ``extra``."""
    paths = [str(STAND_IN), str(REPO), *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(dict.fromkeys(paths)), **extra}


def op_calls() -> dict[str, int]:
    """``{npu op name: times its simulated kernel ran}`` in this process (a copy)."""
    import torch_npu

    return dict(torch_npu._ops.CALLS)


def build_seconds() -> float:
    """Wall seconds the stand-in's C++ extension took to build or load in this process."""
    import torch_npu

    return torch_npu._build.LOAD_SECONDS
