"""Drive transformers' own Ascend NPU flash-attention path on a host without an NPU (tests and benchmarks; test
infrastructure, outside the package).

On an Ascend host, ``attn_implementation="flash_attention_2"`` (verl's default) does not use the
``flash_attn`` package: transformers' ``_lazy_imports`` sees ``is_torch_npu_available()`` and installs
``integrations/npu_flash_attention.py``'s ``npu_flash_attn_func`` (BSND, a single sequence) and
``npu_flash_attn_varlen_func`` (TND, packed sequences), which call ``torch_npu.npu_fusion_attention``
(transformers 4.57.6, 5.10.4 and 5.24.0: ``integrations/npu_flash_attention.py``, the same file in all three).

:func:`simulated_npu_host` makes transformers take exactly that path here: every
``is_torch_npu_available`` name bound in a loaded ``transformers`` module (and in 5.x's
``FLASH_ATTENTION_COMPATIBILITY_MATRIX``) answers True, ``npu_flash_attention.npu_fusion_attention`` is
``torch.ops.npu.npu_fusion_attention`` (our simulated stand-in, :mod:`qwen_npu_compile.ops`, which
implements TND sequence by sequence), and transformers' cached flash-attention implementation is reset so
that the next call imports the NPU functions. Nothing of transformers is re-implemented: its own
``_flash_attention_forward``, ``_is_packed_sequence``, ``prepare_fa_kwargs_from_position_ids`` and NPU
functions run. Everything is restored on exit.

Never use it on a real Ascend host (it refuses when torch_npu is importable: the real path is there). The
simulated Ascend host of the tests (``tests/ascend_host``, ``docs/ascend-host.md``: a stand-in torch_npu, the model
on ``npu``) needs no patching either: transformers finds its NPU functions by itself there, as on a host.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Iterator

import torch

#: transformers modules whose import-time bindings of the NPU check are patched (others are found by scan).
_FA_MODULES = (
    "transformers.modeling_flash_attention_utils",
    "transformers.integrations.npu_flash_attention",
    "transformers.integrations.flash_attention",
    "transformers.modeling_utils",
)


def _true(*_args, **_kwargs) -> bool:
    return True


def _patch_matrix(matrix, original, undo: list) -> None:
    """Replace ``original`` in 5.x's FLASH_ATTENTION_COMPATIBILITY_MATRIX entries (functions held in tuples)."""
    for entry in matrix.values():
        for key, value in list(entry.items()):
            if value is original:
                undo.append((entry.__setitem__, key, value))
                entry[key] = _true
            elif isinstance(value, tuple) and any(isinstance(p, tuple) and p and p[0] is original for p in value):
                undo.append((entry.__setitem__, key, value))
                entry[key] = tuple((_true, *p[1:]) if isinstance(p, tuple) and p and p[0] is original else p
                                   for p in value)


@contextlib.contextmanager
def simulated_npu_host() -> Iterator[None]:
    """Within the block, transformers behaves as on an Ascend host, with our simulated ``npu`` ops.

    A model built inside the block with ``attn_implementation="flash_attention_2"`` (or switched to it)
    runs transformers' NPU flash-attention functions (``npu_fusion_attention`` in BSND / TND with
    ``sparse_mode=3`` and the compressed 2048x2048 causal mask), inside and after the block as long as
    the block is open at forward time.

    Raises:
        RuntimeError: torch_npu is importable (a real Ascend host: use the real path), or transformers'
            ``integrations.npu_flash_attention`` module is missing (an unsupported transformers release).
    """
    from qwen_npu_compile.ops import ensure_npu_ops

    status = ensure_npu_ops()
    if not status.simulated:
        raise RuntimeError("simulated_npu_host: torch_npu is installed here; transformers already takes its NPU path")
    import transformers.utils.import_utils as import_utils

    original = import_utils.is_torch_npu_available
    try:
        modules = [importlib.import_module(name) for name in _FA_MODULES]
    except ImportError as exc:
        raise RuntimeError(
            f"simulated_npu_host: transformers {getattr(sys.modules.get('transformers'), '__version__', '?')} "
            f"has no NPU flash-attention module ({exc}); supported: 4.57.6-5.24"
        ) from exc
    undo: list = []
    for name, module in list(sys.modules.items()):
        if not name.startswith("transformers") or module is None:
            continue
        # the module's own namespace: getattr on transformers' lazy modules would import their submodules
        if vars(module).get("is_torch_npu_available") is original:
            undo.append((setattr, (module, "is_torch_npu_available"), original))
            module.is_torch_npu_available = _true
    fa_utils, npu_fa = modules[0], modules[1]
    matrix = getattr(fa_utils, "FLASH_ATTENTION_COMPATIBILITY_MATRIX", None)
    if isinstance(matrix, dict):
        _patch_matrix(matrix, original, undo)
    undo.append((setattr, (npu_fa, "npu_fusion_attention"), getattr(npu_fa, "npu_fusion_attention", None)))
    npu_fa.npu_fusion_attention = torch.ops.npu.npu_fusion_attention
    loaded = getattr(fa_utils, "_loaded_implementation", None)
    fa_utils._loaded_implementation = None  # the next flash-attention call imports the NPU functions
    try:
        yield
    finally:
        for setter, key, value in reversed(undo):
            if setter is setattr:
                setattr(*key, value)
            else:
                setter(key, value)
        fa_utils._loaded_implementation = None if loaded == "flash_attention_2" else loaded
