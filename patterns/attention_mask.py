"""Old path of :mod:`qwen_npu_compile.patterns.attention.masks` (proving, converting and sharing attention
masks): an alias, not a copy, so this path and the package module are one module object (patching one
patches the other)."""

import sys

from .attention import masks as _module

sys.modules[__name__] = _module
