"""Stable entry point ``qwen_npu_compile.verl``: the name users give verl (``VERL_USE_EXTERNAL_MODULES=qwen_npu_compile.verl``);
importing it installs the hook of :mod:`qwen_npu_compile.integrations.verl` when ``QWEN_NPU_COMPILE`` is on.

An alias, not a copy: this path and the integration are one module object (see
:mod:`qwen_npu_compile.integrations`).
"""

import sys

from .integrations import verl as _module

sys.modules[__name__] = _module
