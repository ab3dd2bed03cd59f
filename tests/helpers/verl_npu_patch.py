"""verl's own ``npu_patch`` run on a CPU: its ``import torch_npu`` gets a throwaway module whose functions are the
``torch.ops.npu`` stand-ins, and ``torch.histc`` takes the integer input verl's MoE block gives it."""

from __future__ import annotations

import contextlib
import importlib
import importlib.machinery
import sys
import types

import pytest
import torch

NPU_PATCH = "verl.models.transformers.npu_patch"
npu = torch.ops.npu


def stand_in_torch_npu() -> types.ModuleType:
    """A throwaway ``torch_npu`` module whose six functions verl's ``npu_patch`` calls are the
    ``torch.ops.npu`` ops (our stand-ins here, the same schemas as torch_npu 2.13.0)."""
    module = types.ModuleType("torch_npu", "qwen_npu tests: verl npu_patch's torch_npu, on torch.ops.npu stand-ins")
    module.__spec__ = importlib.machinery.ModuleSpec("torch_npu", None)
    module.npu_grouped_matmul = lambda x, weight, **kwargs: npu.npu_grouped_matmul.default(x, weight, **kwargs)
    module.npu_swiglu = lambda x, dim=-1: npu.npu_swiglu.default(x, dim)
    module.npu_rms_norm = lambda x, gamma, epsilon=1e-6: npu.npu_rms_norm.default(x, gamma, epsilon)
    module.npu_rotary_mul = lambda x, r1, r2: npu.npu_rotary_mul.default(x, r1, r2)
    module.npu_moe_token_permute = lambda tokens, indices, num_out_tokens=None, padded_mode=False: (
        npu.npu_moe_token_permute.default(tokens, indices, num_out_tokens, padded_mode))
    module.npu_moe_token_unpermute = lambda permuted, sorted_indices, probs=None, padded_mode=False, restore_shape=None: (
        npu.npu_moe_token_unpermute.default(permuted, sorted_indices, probs, padded_mode, restore_shape))
    return module


#: torch's own ``torch.histc`` (restored after :func:`histc_any_dtype` stood in for it)
HISTC = torch.histc


def histc_any_dtype(input, bins=100, min=0, max=0, *, out=None):  # noqa: A002 (torch.histc's names)
    """``torch.histc`` that also takes integer input on a CPU (counted as float, returned in the input's dtype)."""
    if input.is_floating_point() or out is not None:
        return HISTC(input, bins, min, max, out=out)
    return HISTC(input.float(), bins, min, max).to(input.dtype)


@contextlib.contextmanager
def verl_qwen3_moe_patched():
    """verl's real ``npu_patch._patch_qwen3_moe()`` on transformers' Qwen3-MoE, undone on exit (the three
    patched names restored, ``npu_patch`` dropped from ``sys.modules``, ``torch.histc`` restored)."""
    from qwen_npu_compile import ensure_npu_ops

    if not ensure_npu_ops().simulated:  # before any torch_npu is put in sys.modules
        pytest.skip("real torch_npu present: verl's npu_patch runs on it as is")
    import verl.models.transformers  # noqa: F401  (its imports look for torch_npu; the real answer: none)
    from transformers.models.qwen3_moe import modeling_qwen3_moe as modeling

    saved = (modeling.Qwen3MoeRMSNorm.forward, modeling.Qwen3MoeSparseMoeBlock.forward, modeling.apply_rotary_pos_emb)
    had_module = NPU_PATCH in sys.modules
    sys.modules["torch_npu"] = stand_in_torch_npu()
    try:
        npu_patch = importlib.import_module(NPU_PATCH)
        npu_patch.torch_npu = sys.modules["torch_npu"]
    finally:
        del sys.modules["torch_npu"]
    torch.histc = histc_any_dtype
    try:
        npu_patch._patch_qwen3_moe()
        yield npu_patch
    finally:
        modeling.Qwen3MoeRMSNorm.forward, modeling.Qwen3MoeSparseMoeBlock.forward, modeling.apply_rotary_pos_emb = saved
        torch.histc = HISTC
        if not had_module:
            sys.modules.pop(NPU_PATCH, None)
