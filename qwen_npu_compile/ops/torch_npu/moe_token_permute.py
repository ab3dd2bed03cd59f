"""Stand-ins for ``npu_moe_token_permute`` / ``npu_moe_token_unpermute`` and their backward ops (torch_npu 2.13.0).

This project never emits these ops; verl's ``npu_patch`` does (``_qwen3_sparse_moe_routed_forward_npu``,
verl 0.9.1), so a verl-patched MoE block runs, traces and compiles on a CPU with them. Sources (torch_npu
2.13.0 wheel): schemas ``torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml`` (verbatim below), meta
kernels ``torch_npu/op_plugin/meta/_meta_registrations.py``, semantics and limits ``torch_npu/_op_plugin_docs.py``.

Semantics (``_op_plugin_docs.py``), ``N`` tokens, ``K`` = topK, ``H`` hidden:

- ``npu_moe_token_permute(tokens [N, H], indices [N, K] | [N])`` -> ``(permuted_tokens [N·K, H],
  sorted_indices int32 [N·K])``: the ``N·K`` (token, expert) rows sorted by expert id;
  ``permuted_tokens[sorted_indices[i]] = tokens[i // K]``. The kernel is deterministic; the stand-in sorts
  stably (ties keep the flattened order). ``num_out_tokens`` > 0 keeps the first ``min(N·K, num_out_tokens)``
  sorted rows, < 0 slices as a negative index, None/0 keeps all (the meta kernel's size rule).
- ``npu_moe_token_unpermute(permuted_tokens [N·K, H], sorted_indices int32 [N·K], probs [N, K] | None)``
  -> ``[N, H]``: ``out[t] = sum_k permuted_tokens[sorted_indices[t·K + k]] · probs[t, k]`` (K = 1 and no
  weights without ``probs``). The stand-in accumulates in fp32 and rounds once.

Autograd (torch_npu's generated ``NpuMoeTokenPermuteBackward0`` / ``NpuMoeTokenUnpermuteBackward0``, in
``libtorch_npu.so``; op-plugin ``derivatives.yaml``: ``tokens: npu_moe_token_permute_grad_v2(grad, result1,
tokens.size(0), tokens.scalar_type(), topK, padded_mode)``; the unpermute forward saves ``permuted_tokens``
for ``npu_moe_token_unpermute_grad_v2``, op-plugin ``MoeTokenUnpermuteKernelNpuOpApi.cpp``):

- ``npu_moe_token_permute_grad_v2``: ``grad_tokens[t] = sum_k grad_permuted[sorted_indices[t·K + k]]``
  (rows dropped by ``num_out_tokens`` contribute 0);
- ``npu_moe_token_unpermute_grad_v2``: ``grad_permuted[sorted_indices[i]] = grad[i // K] · probs.flat[i]``,
  ``grad_probs[t, k] = <grad[t], permuted_tokens[sorted_indices[t·K + k]]>``. Without ``probs`` the real
  op returns a placeholder ``grad_probs`` (the meta kernel: None); the stand-in returns an empty ``[0]`` tensor.

Limits (``_op_plugin_docs.py``): tokens 2-D fp16/bf16/fp32; indices 1-D/2-D int32/int64 with fewer than
16777215 elements, values in ``[0, 16777215)``; topK <= 512 (unpermute, Atlas A2/A3); sorted_indices int32;
``padded_mode`` only False, ``restore_shape`` only None. The stand-ins raise on anything else.
Not registered: the v1 grad ops ``npu_moe_token_permute_grad`` / ``npu_moe_token_unpermute_grad`` and the
internal ``_npu_moe_token_unpermute`` (the autograd above does not call them). torchair (torch_npu 2.13.0)
has no GE converter for any of these ops.
"""

from __future__ import annotations

import torch

from qwen_npu_compile.ops.define import define_op

#: torch_npu 2.13.0 schemas, verbatim (``npu_native_functions_by_codegen.yaml``).
PERMUTE_SCHEMA = (
    "npu_moe_token_permute(Tensor tokens, Tensor indices, int? num_out_tokens=None, bool padded_mode=False) "
    "-> (Tensor, Tensor)"
)
PERMUTE_GRAD_V2_SCHEMA = (
    "npu_moe_token_permute_grad_v2(Tensor grad_permuted_tokens, Tensor sorted_indices, SymInt tokens_size_0, "
    "ScalarType tokens_dtype, SymInt num_topK, bool padded_mode=False) -> Tensor"
)
UNPERMUTE_SCHEMA = (
    "npu_moe_token_unpermute(Tensor permuted_tokens, Tensor sorted_indices, Tensor? probs=None, "
    "bool padded_mode=False, int[]? restore_shape=None) -> Tensor"
)
UNPERMUTE_GRAD_V2_SCHEMA = (
    "npu_moe_token_unpermute_grad_v2(Tensor grad_unpermuted_tokens, Tensor sorted_indices, "
    "SymInt permuted_tokens_size_0, ScalarType permuted_tokens_dtype, Tensor? probs=None, bool padded_mode=False, "
    "int[]? restore_shape=None, Tensor? permuted_tokens=None) -> (Tensor, Tensor)"
)
#: Every op this module registers (torch_npu 2.13.0 names).
OPS = ("npu_moe_token_permute", "npu_moe_token_permute_grad_v2", "npu_moe_token_unpermute",
       "npu_moe_token_unpermute_grad_v2")

#: tokens / permuted_tokens / probs dtypes (``_op_plugin_docs.py``; int8 only on Ascend 950, not simulated).
SUPPORTED_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32})
#: indices: int32 or int64 ("数据类型支持int32、int64"); sorted_indices: int32.
INDEX_DTYPES = frozenset({torch.int32, torch.int64})
#: "元素个数小于16777215，元素值大于等于0且小于16777215".
MAX_INDICES = 16777215
#: "topK_num要求小于等于512" (npu_moe_token_unpermute, Atlas A2/A3).
MAX_TOPK = 512


def permute_violation(tokens, indices, num_out_tokens=None, padded_mode=False) -> str | None:
    """Why ``npu_moe_token_permute(tokens, indices, ...)`` would fail (shapes and dtypes only), or None.

    Args:
        tokens: ``[N, H]`` fp16/bf16/fp32; indices: ``[N, K]`` or ``[N]`` int32/int64 expert ids (tensors or
            FakeTensors). Limits: module docstring.
    """
    if tokens.dim() != 2:
        return f"tokens must be 2-D [N, H], got {tokens.dim()}-D"
    if indices.dim() not in (1, 2):
        return f"indices must be 1-D or 2-D, got {indices.dim()}-D"
    if tokens.dtype not in SUPPORTED_DTYPES:
        return f"unsupported tokens dtype {tokens.dtype}; npu_moe_token_permute takes fp16, bf16, fp32"
    if indices.dtype not in INDEX_DTYPES:
        return f"indices must be int32/int64, got {indices.dtype}"
    if padded_mode:
        return "padded_mode=True is not supported (torch_npu 2.13.0: only False)"
    return None


def unpermute_violation(permuted_tokens, sorted_indices, probs=None, padded_mode=False, restore_shape=None) -> str | None:
    """Why ``npu_moe_token_unpermute(permuted_tokens, sorted_indices, probs, ...)`` would fail, or None.

    Args:
        permuted_tokens: ``[R, H]`` (R >= N·K) fp16/bf16/fp32; sorted_indices: int32 ``[N·K]``; probs: ``[N, K]``
            fp16/bf16/fp32 or None (K = 1). Limits: module docstring.
    """
    if permuted_tokens.dim() != 2 or sorted_indices.dim() != 1:
        return (f"permuted_tokens must be 2-D and sorted_indices 1-D, got {permuted_tokens.dim()}-D and "
                f"{sorted_indices.dim()}-D")
    if permuted_tokens.dtype not in SUPPORTED_DTYPES:
        return f"unsupported dtype {permuted_tokens.dtype}; npu_moe_token_unpermute takes fp16, bf16, fp32"
    if sorted_indices.dtype != torch.int32:
        return f"sorted_indices must be int32, got {sorted_indices.dtype}"
    if probs is not None:
        if probs.dim() != 2 or probs.dtype not in SUPPORTED_DTYPES:
            return f"probs must be 2-D fp16/bf16/fp32 [N, K], got {probs.dtype} {tuple(probs.shape)}"
        if probs.shape[1] > MAX_TOPK:
            return f"topK {probs.shape[1]} > {MAX_TOPK}"
        if probs.numel() != sorted_indices.shape[0]:
            return f"probs {tuple(probs.shape)} does not match {sorted_indices.shape[0]} sorted indices"
    if padded_mode or restore_shape is not None:
        return "padded_mode=True / restore_shape are not supported (torch_npu 2.13.0: False / None only)"
    return None


def _raise(op: str, reason: str | None) -> None:
    if reason is not None:
        raise RuntimeError(f"{op}: {reason}")


def _out_rows(num_out_tokens, flat: int) -> int:
    """The meta kernel's rule for ``permuted_tokens.size(0)``."""
    value = 0 if num_out_tokens is None else num_out_tokens
    return min(value, flat) if value > 0 else value + flat


def _topk(indices: torch.Tensor) -> int:
    return 1 if indices.dim() == 1 else indices.shape[1]


def reference_permute(tokens, indices, num_out_tokens=None, padded_mode=False):
    """CPU reference of ``npu_moe_token_permute``.

    Args:
        tokens: ``[N, H]`` fp16/bf16/fp32. indices: int32/int64 ``[N, K]`` (or ``[N]``: K = 1), expert ids.
        num_out_tokens: rows kept (module docstring); padded_mode: False only.

    Returns:
        ``(permuted_tokens [R, H] tokens' dtype, sorted_indices int32 [N·K])``, R = N·K unless num_out_tokens cuts.

    Raises:
        RuntimeError: a broken limit (:func:`permute_violation`, index values outside ``[0, 16777215)``).
    """
    _raise("npu_moe_token_permute", permute_violation(tokens, indices, num_out_tokens, padded_mode))
    flat = indices.reshape(-1).to(torch.int64)
    if flat.numel() >= MAX_INDICES or (flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= MAX_INDICES)):
        raise RuntimeError(f"npu_moe_token_permute: indices need fewer than {MAX_INDICES} elements in [0, {MAX_INDICES})")
    order = torch.sort(flat, stable=True).indices  # order[j]: the flattened (token, k) row at sorted position j
    sorted_indices = torch.empty_like(order)
    sorted_indices[order] = torch.arange(order.numel(), device=order.device)
    rows = _out_rows(num_out_tokens, flat.numel())
    permuted = tokens.index_select(0, order[:rows] // _topk(indices))
    return permuted.contiguous(), sorted_indices.to(torch.int32)


def _fake_permute(tokens, indices, num_out_tokens=None, padded_mode=False):
    _raise("npu_moe_token_permute", permute_violation(tokens, indices, num_out_tokens, padded_mode))
    rows = _out_rows(num_out_tokens, indices.numel())
    return tokens.new_empty((rows, tokens.shape[1])), tokens.new_empty((indices.numel(),), dtype=torch.int32)


def reference_permute_grad_v2(grad_permuted_tokens, sorted_indices, tokens_size_0, tokens_dtype, num_topK,
                              padded_mode=False):
    """CPU reference of ``npu_moe_token_permute_grad_v2`` (the backward of ``npu_moe_token_permute``).

    Args:
        grad_permuted_tokens: ``[R, H]``; sorted_indices: int32 ``[N·K]``; tokens_size_0: N; tokens_dtype: the
            output dtype; num_topK: K.

    Returns:
        ``[N, H]`` in ``tokens_dtype``: ``sum_k grad_permuted_tokens[sorted_indices[t·K + k]]`` (fp32 sums; rows
        at or beyond R contribute 0).
    """
    if padded_mode:
        raise RuntimeError("npu_moe_token_permute_grad_v2: padded_mode=True is not supported")
    rows = grad_permuted_tokens.shape[0]
    index = sorted_indices.to(torch.int64)
    kept = index < rows
    picked = grad_permuted_tokens.float().index_select(0, index.clamp(max=max(rows - 1, 0))) if rows else \
        grad_permuted_tokens.new_zeros((index.numel(), grad_permuted_tokens.shape[1]), dtype=torch.float32)
    picked = picked * kept.unsqueeze(1)
    return picked.reshape(tokens_size_0, num_topK, -1).sum(1).to(tokens_dtype)


def _fake_permute_grad_v2(grad_permuted_tokens, sorted_indices, tokens_size_0, tokens_dtype, num_topK,
                          padded_mode=False):
    return grad_permuted_tokens.new_empty((tokens_size_0, grad_permuted_tokens.shape[1]), dtype=tokens_dtype)


def _permute_setup_context(ctx, inputs, output):
    tokens, indices, _num_out_tokens, padded_mode = inputs
    ctx.save_for_backward(output[1])
    ctx.tokens_size_0, ctx.tokens_dtype, ctx.topk, ctx.padded_mode = tokens.shape[0], tokens.dtype, _topk(indices), padded_mode


def _permute_backward(ctx, grad_permuted, _grad_sorted_indices):
    (sorted_indices,) = ctx.saved_tensors
    grad = torch.ops.npu.npu_moe_token_permute_grad_v2.default(
        grad_permuted.contiguous(), sorted_indices, ctx.tokens_size_0, ctx.tokens_dtype, ctx.topk, ctx.padded_mode)
    return grad, None, None, None


def reference_unpermute(permuted_tokens, sorted_indices, probs=None, padded_mode=False, restore_shape=None):
    """CPU reference of ``npu_moe_token_unpermute``.

    Args:
        permuted_tokens: ``[R, H]`` fp16/bf16/fp32 (``npu_moe_token_permute``'s first output, after the experts).
        sorted_indices: int32 ``[N·K]`` (its second output); probs: ``[N, K]`` or None (K = 1, no weights).

    Returns:
        ``[N, H]`` in permuted_tokens' dtype: ``sum_k permuted_tokens[sorted_indices[t·K + k]] · probs[t, k]``.
    """
    _raise("npu_moe_token_unpermute", unpermute_violation(permuted_tokens, sorted_indices, probs, padded_mode,
                                                          restore_shape))
    topk = 1 if probs is None else probs.shape[1]
    rows = permuted_tokens.float().index_select(0, sorted_indices.to(torch.int64))
    rows = rows.reshape(-1, topk, permuted_tokens.shape[1])
    if probs is not None:
        rows = rows * probs.float().unsqueeze(-1)
    return rows.sum(1).to(permuted_tokens.dtype)


def _fake_unpermute(permuted_tokens, sorted_indices, probs=None, padded_mode=False, restore_shape=None):
    _raise("npu_moe_token_unpermute", unpermute_violation(permuted_tokens, sorted_indices, probs, padded_mode,
                                                          restore_shape))
    topk = 1 if probs is None else probs.shape[1]
    return permuted_tokens.new_empty((sorted_indices.shape[0] // topk, permuted_tokens.shape[1]))


def reference_unpermute_grad_v2(grad_unpermuted_tokens, sorted_indices, permuted_tokens_size_0, permuted_tokens_dtype,
                                probs=None, padded_mode=False, restore_shape=None, permuted_tokens=None):
    """CPU reference of ``npu_moe_token_unpermute_grad_v2`` (the backward of ``npu_moe_token_unpermute``).

    Args:
        grad_unpermuted_tokens: ``[N, H]``; sorted_indices: int32 ``[N·K]``; permuted_tokens_size_0: R;
            permuted_tokens_dtype: grad_permuted's dtype; probs: ``[N, K]`` or None; permuted_tokens: ``[R, H]``
            (needed for grad_probs when probs is given).

    Returns:
        ``(grad_permuted [R, H] permuted_tokens_dtype, grad_probs [N, K] probs' dtype)`` (module docstring; rows
        no index points at are 0; without probs grad_probs is an empty ``[0]`` tensor).
    """
    if padded_mode or restore_shape is not None:
        raise RuntimeError("npu_moe_token_unpermute_grad_v2: padded_mode=True / restore_shape are not supported")
    index = sorted_indices.to(torch.int64)
    topk = 1 if probs is None else probs.shape[1]
    hidden = grad_unpermuted_tokens.shape[1]
    grad = grad_unpermuted_tokens.float().unsqueeze(1).expand(-1, topk, -1)
    scaled = grad * probs.float().unsqueeze(-1) if probs is not None else grad
    grad_permuted = grad_unpermuted_tokens.new_zeros((permuted_tokens_size_0, hidden), dtype=torch.float32)
    grad_permuted.index_copy_(0, index, scaled.reshape(-1, hidden))
    grad_permuted = grad_permuted.to(permuted_tokens_dtype)
    if probs is None:
        return grad_permuted, grad_unpermuted_tokens.new_empty((0,))
    if permuted_tokens is None:
        raise RuntimeError("npu_moe_token_unpermute_grad_v2: permuted_tokens is required when probs is given")
    rows = permuted_tokens.float().index_select(0, index).reshape(-1, topk, hidden)
    grad_probs = (rows * grad).sum(-1).to(probs.dtype)
    return grad_permuted, grad_probs


def _fake_unpermute_grad_v2(grad_unpermuted_tokens, sorted_indices, permuted_tokens_size_0, permuted_tokens_dtype,
                            probs=None, padded_mode=False, restore_shape=None, permuted_tokens=None):
    grad_permuted = grad_unpermuted_tokens.new_empty((permuted_tokens_size_0, grad_unpermuted_tokens.shape[1]),
                                                     dtype=permuted_tokens_dtype)
    grad_probs = torch.empty_like(probs) if probs is not None else grad_unpermuted_tokens.new_empty((0,))
    return grad_permuted, grad_probs


def _unpermute_setup_context(ctx, inputs, output):
    permuted_tokens, sorted_indices, probs, padded_mode, restore_shape = inputs
    ctx.save_for_backward(permuted_tokens, sorted_indices, probs)
    ctx.size_0, ctx.dtype = permuted_tokens.shape[0], permuted_tokens.dtype
    ctx.padded_mode, ctx.restore_shape = padded_mode, restore_shape


def _unpermute_backward(ctx, grad):
    permuted_tokens, sorted_indices, probs = ctx.saved_tensors
    grad_permuted, grad_probs = torch.ops.npu.npu_moe_token_unpermute_grad_v2.default(
        grad.contiguous(), sorted_indices, ctx.size_0, ctx.dtype, probs, ctx.padded_mode, ctx.restore_shape,
        permuted_tokens if probs is not None else None)
    return grad_permuted, None, (grad_probs if probs is not None else None), None, None


def register(lib: torch.library.Library) -> None:
    """Define the four ops of :data:`OPS` in ``lib`` (the ``npu`` namespace): kernels, fakes, and autograd for
    the two forward ops (their backward calls the ``*_grad_v2`` op, as torch_npu's does)."""
    define_op(lib, PERMUTE_SCHEMA, reference_permute, _fake_permute, _permute_backward, _permute_setup_context)
    define_op(lib, PERMUTE_GRAD_V2_SCHEMA, reference_permute_grad_v2, _fake_permute_grad_v2)
    define_op(lib, UNPERMUTE_SCHEMA, reference_unpermute, _fake_unpermute, _unpermute_backward, _unpermute_setup_context)
    define_op(lib, UNPERMUTE_GRAD_V2_SCHEMA, reference_unpermute_grad_v2, _fake_unpermute_grad_v2)
