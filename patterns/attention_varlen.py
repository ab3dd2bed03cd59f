"""Old path of :mod:`qwen_npu_compile.patterns.attention.varlen` (packed sequences -> varlen attention; the
proof of the packed mask is :mod:`qwen_npu_compile.patterns.attention.packed`, whose names it re-exports): an
alias, not a copy, so this path and the package module are one module object (patching one patches the other)."""

import sys

from .attention import varlen as _module

sys.modules[__name__] = _module
