"""Stable entry point ``qwen_npu_compile.worker``: per-layer compile in place (``maybe_compile``, ``layer_reports``,
``ENV_COMPILE``); the code is :mod:`qwen_npu_compile.integrations.worker`.

An alias, not a copy: this path and the integration are one module object (see
:mod:`qwen_npu_compile.integrations`).
"""

import sys

from .integrations import worker as _module

sys.modules[__name__] = _module
