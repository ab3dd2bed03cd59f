"""Build (once, cached) and load the simulated device's C++ extension (``csrc/npu_sim.cpp``).

The build folder is ``$QWEN_NPU_SIM_BUILD/<key>``, else
``$XDG_CACHE_HOME/qwen_npu_compile/npu_sim-<torch version>-<key>`` (``~/.cache/...``), where ``<key>`` is
:func:`build_key`: a hash of the source and the compiler flags. A changed source thus builds into a fresh
folder in every process and on CI (no reliance on ninja's timestamps, and no library rewritten under a
process that has it loaded); ``torch.utils.cpp_extension.load`` only loads the library when it is there.
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import torch

SOURCE = Path(__file__).resolve().parent / "csrc" / "npu_sim.cpp"
CFLAGS = ["-O1"]

#: wall seconds the last :func:`load` took (a build, or loading the cached library)
LOAD_SECONDS = 0.0


def build_key() -> str:
    """12 hex digits of SHA-256 over the source and :data:`CFLAGS`: changes whenever the built library would."""
    digest = hashlib.sha256(SOURCE.read_bytes())
    digest.update(repr(CFLAGS).encode())
    return digest.hexdigest()[:12]


def build_dir() -> Path:
    named = os.environ.get("QWEN_NPU_SIM_BUILD")
    if named:
        folder = Path(named) / build_key()
    else:
        cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
        folder = cache / "qwen_npu_compile" / f"npu_sim-{torch.__version__.replace('+', '_')}-{build_key()}"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def load():
    """The loaded extension module (built into :func:`build_dir` the first time: about 35 s on 2 cores)."""
    global LOAD_SECONDS
    from torch.utils.cpp_extension import load as load_extension

    start = time.perf_counter()
    module = load_extension(name="qwen_npu_sim", sources=[str(SOURCE)], build_directory=str(build_dir()),
                            extra_cflags=CFLAGS, verbose=False)
    LOAD_SECONDS = time.perf_counter() - start
    return module
