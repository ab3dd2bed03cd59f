"""Stable entry point ``qwen_npu_compile.verl``: the hook into verl's FSDP engine; importing it installs the hook when ``QWEN_NPU_COMPILE`` is on.

Users write this path (``VERL_USE_EXTERNAL_MODULES=qwen_npu_compile.verl``); the code is
:mod:`qwen_npu_compile.integrations.verl`. This module puts that module in its own place in
``sys.modules``, and Python's import binds whatever ``sys.modules`` holds once the module has run
(importlib ``_load_unlocked``), so both paths name the same module object: its import side effects
run once and a monkeypatch through either path is seen by both.
"""

import sys

from .integrations import verl as _module

sys.modules[__name__] = _module
