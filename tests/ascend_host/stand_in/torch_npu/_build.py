"""Build (once, cached) and load the simulated device's C++ extension (``csrc/npu_sim.cpp``).

The build folder is ``$QWEN_NPU_SIM_BUILD``, else ``$XDG_CACHE_HOME/qwen_npu_compile/npu_sim-<torch version>``
(``~/.cache/...``); ``torch.utils.cpp_extension.load`` rebuilds only when the source or flags change.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

SOURCE = Path(__file__).resolve().parent / "csrc" / "npu_sim.cpp"

#: wall seconds the last :func:`load` took (a build, or loading the cached library)
LOAD_SECONDS = 0.0


def build_dir() -> Path:
    named = os.environ.get("QWEN_NPU_SIM_BUILD")
    if named:
        folder = Path(named)
    else:
        cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
        folder = cache / "qwen_npu_compile" / f"npu_sim-{torch.__version__.replace('+', '_')}"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def load():
    """The loaded extension module (built into :func:`build_dir` the first time: about 35 s on 2 cores)."""
    global LOAD_SECONDS
    from torch.utils.cpp_extension import load as load_extension

    start = time.perf_counter()
    module = load_extension(name="qwen_npu_sim", sources=[str(SOURCE)], build_directory=str(build_dir()),
                            extra_cflags=["-O1"], verbose=False)
    LOAD_SECONDS = time.perf_counter() - start
    return module
