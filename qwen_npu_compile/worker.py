"""Stable entry point ``qwen_npu_compile.worker``: per-layer compile in place, switched by ``QWEN_NPU_COMPILE``.

Users write this path (``from qwen_npu_compile.worker import layer_reports, ENV_COMPILE``); the code is
:mod:`qwen_npu_compile.integrations.worker`. This module puts that module in its own place in
``sys.modules``, and Python's import binds whatever ``sys.modules`` holds once the module has run
(importlib ``_load_unlocked``), so both paths name the same module object: its import side effects
run once and a monkeypatch through either path is seen by both.
"""

import sys

from .integrations import worker as _module

sys.modules[__name__] = _module
