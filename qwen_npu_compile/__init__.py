"""qwen_npu_compile: a ``torch.compile`` backend that fuses Qwen2/Qwen2.5 subgraphs into Ascend NPU ops.

Use it as ``torch.compile(model, backend="qwen_npu")`` (registered by entry point). Importing this
package never imports torch_npu; the npu ops are resolved (real or simulated) at the first compile.
"""

from . import compat
from .config import ALL_FAMILIES, QwenNpuConfig
from .npu_ops import NpuOpsStatus, ensure_npu_ops
from .report import FusionError, GraphReport, get_reports
from .integrations.worker import CompiledLayers, maybe_compile
from .torch_compiler import torch_compile

__all__ = [
    "ALL_FAMILIES",
    "CompiledLayers",
    "FusionError",
    "GraphReport",
    "NpuOpsStatus",
    "QwenNpuConfig",
    "ensure_npu_ops",
    "get_reports",
    "maybe_compile",
    "torch_compile",
]
__version__ = "0.1.0"

# Before Dynamo traces any frame for this backend (a compile-start callback): transformers 5.10.4's MoE
# experts probe the torch version while traced (compat.transformers_version_probes_constant).
compat.install_tracing_fixes()
