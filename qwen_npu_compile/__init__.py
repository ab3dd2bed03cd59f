"""qwen_npu_compile: a ``torch.compile`` backend that fuses Qwen-family subgraphs (dense Qwen2/2.5/3, Qwen MoE,
the Qwen3.5 / Qwen3-Next hybrids of Gated DeltaNet and gated attention) into Ascend NPU ops.

Use it as ``torch.compile(model, backend="qwen_npu")`` (registered by entry point). Importing this
package never imports torch_npu; the npu ops are resolved (real or simulated) at the first compile.

The public names below import torch. Where torch is already imported (the usual case, and always when
torch's backend registry loads ``qwen_npu``), they are imported with the package, as before; otherwise
at their first use (PEP 562 ``__getattr__``), so that ``qwen-npu-compile --help`` and ``report``, which
need no torch, start in a fraction of a second.
"""

import importlib as _importlib
import sys as _sys

#: public name -> the submodule that defines it
_PUBLIC = {
    "ALL_FAMILIES": "config",
    "CompiledLayers": "worker",
    "FusionError": "report",
    "GraphReport": "report",
    "NpuOpsStatus": "ops",
    "QwenNpuConfig": "config",
    "QwenNpuConfigError": "config",
    "ensure_npu_ops": "ops",
    "get_reports": "report",
    "maybe_compile": "worker",
    "torch_compile": "integrations.torch_compiler",
}

__all__ = sorted(_PUBLIC)
__version__ = "0.1.0"


def _load_public() -> None:
    """Import the public names (and torch), and install the tracing fixes; once."""
    from . import compat

    for name, module in _PUBLIC.items():
        globals()[name] = getattr(_importlib.import_module(f"{__name__}.{module}"), name)
    # Before Dynamo traces any frame for this backend (a compile-start callback): transformers 5.10.4's MoE
    # experts probe the torch version while traced (compat.transformers_version_probes_constant). The
    # backend module and maybe_compile install it too (a package imported before torch loads lazily).
    compat.install_tracing_fixes()


def __getattr__(name: str):
    if name in _PUBLIC:
        _load_public()
        return globals()[name]
    try:  # a submodule used as an attribute (``qwen_npu_compile.compat``) before anything imported it
        return _importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as exc:
        if exc.name != f"{__name__}.{name}":
            raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if "torch" in _sys.modules:
    _load_public()
