"""Stable entry point ``qwen_npu_compile.hf_trainer``: ``from qwen_npu_compile.hf_trainer import QwenNpuCompileCallback``;
the code is :mod:`qwen_npu_compile.integrations.hf_trainer`.

An alias, not a copy: this path and the integration are one module object (see
:mod:`qwen_npu_compile.integrations`).
"""

import sys

from .integrations import hf_trainer as _module

sys.modules[__name__] = _module
