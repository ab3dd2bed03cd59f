"""The dense rewrite: a table row's match -> one ``npu_fusion_attention`` call (BSH views or BNSD), with its
check. Imports :mod:`.spellings` and :mod:`.masks`; :mod:`.varlen` and :mod:`.family` import it.

FX before (shape 1, GQA, D = 64)::

    unsqueeze = aten.unsqueeze.default(k, 2)
    expand = aten.expand.default(unsqueeze, [B, Nkv, n_rep, S, 64])
    reshape = aten.reshape.default(expand, [B, Nq, S, 64])                   # repeated K: a copy
    (the same for v -> reshape_1)
    sdpa = aten.scaled_dot_product_attention.default(q, reshape, reshape_1, mask, scale=0.125)

FX after (q, k, v all dense BSND in memory: BSH views, no copy; otherwise ``.contiguous()`` + BNSD)::

    logical_not = aten.logical_not.default(mask)              # True = masked out (its .contiguous() traces away)
    transpose = aten.transpose.int(q, 1, 2);  reshape = aten.reshape.default(transpose, [B, S, Nq*64])
    (the same for k, v with Nkv*64: native GQA, K/V not repeated)
    npu_fusion_attention = npu.npu_fusion_attention.default(reshape, reshape_1, reshape_2, Nq, 'BSH',
        atten_mask=logical_not, scale=0.125, keep_prob=1.0, inner_precise=2)
    getitem = operator.getitem(npu_fusion_attention, 0)
    view = aten.view.default(getitem, [B, S, Nq, 64]);  out = aten.transpose.int(view, 1, 2)

Shape 2 (``is_causal=True``) gets ``atten_mask = ones(2048, 2048, bool).triu(1)`` (two small nodes,
:func:`~qwen_npu_compile.ops.attention_contract.compressed_causal_mask`; 4 MiB per layer, saved for
backward) with ``sparse_mode=2``; the eager chain gets ``atten_mask = mask != 0``. Inputs that are not all
dense BSND (the KV cache's ``cat`` outputs are BNSD-contiguous) take ``'BNSD'`` and ``.contiguous()``.

An explicit mask (shape 1, or the eager chain's additive mask) that is provably the plain causal mask
gets the same ``sparse_mode=2`` and compressed mask instead of ``logical_not(mask)`` (the eager chain then
has no fully masked row to recompute): the mask is a graph constant built from sizes only (no padding
mask, no user-passed position ids, static S) and its compile-time value is ``tril(ones(S, S))``
(:func:`.masks.causal_mask_reason`). That is what transformers 5.x builds for every compiled
training forward without ``attention_mask`` (its packed-sequence mask from the default position ids) and
4.57 for every compiled forward; the ``[B, 1, S, S]`` mask subgraph then becomes dead code. Which form was
chosen, and why an explicit mask was kept, is logged at DEBUG (logger
``qwen_npu_compile.patterns.attention.masks``) and visible in the dump's ``rewritten.py`` (``sparse_mode``).
Padding and packed sequences keep the explicit mask: the kernel's ``actual_seq_qlen``/``actual_seq_kvlen``
(varlen) work only in the TND layout, which torchair's GE converter refuses (BSH and BNSD only), and in
BSH/BNSD key padding has no other form than an S×S mask.

Constraints (``docs/npu-op-contracts.md``; torch_npu 2.13.0 ``npu_fusion_attention`` docs,
Meta kernel and torchair GE converter). Every limit of the op lives in
:func:`~qwen_npu_compile.ops.torch_npu.fusion_attention.fusion_attention_violation`; what the masks need lives
in :mod:`.masks`. This module adds what the *rewrite* needs:

- ``head_num`` = Nq and native GQA (query head h reads kv head h // n_rep, which is what repeat_kv
  builds): n_rep is taken from the shapes and re-checked against the matched expand
  (:func:`_repeat_kv_reason`).
- ``atten_mask`` is bool with **True = masked out** (:func:`.masks.masked_out`); an additive
  float mask must be provably 0 / ``finfo.min`` (:func:`.masks.check_additive_mask`).
  ``is_causal`` (left-up, as in PyTorch), and an explicit mask proven to be ``tril`` with Sq == Skv, is
  ``sparse_mode=2`` with the 2048x2048 compressed mask (what the torch_npu docs require for mode 2).
  ``scale`` defaults to 1.0 in the op: always passed explicitly, as a Python float
  (:func:`~qwen_npu_compile.ops.scalars.scalar_argument`).
- ``inner_precise=2`` with an explicit mask: left padding masks whole query rows, which only mode 2
  computes correctly. Such rows give 0, as PyTorch SDPA (>= 2.5) gives; HF's *eager* chain gives the mean
  of V there instead, so the fused eager chain replaces those rows by exactly that
  (:func:`.masks.eager_fully_masked_rows`).
- ``keep_prob = 1 - dropout_p``: dropout is refused for torchair (its GE converter takes ``keep_prob == 1``
  only) and for the simulated stand-ins, whose dropout mask is a fixed function of (shape, seed=0,
  offset=0): every layer and every step would drop the same positions, silently making training dropout
  deterministic (the real kernel draws a fresh Philox seed per call). Only real ops with a non-GE
  downstream fuse it.
- The kernel needs contiguous inputs (vllm-ascend #2388, #11834): when q, k and v are all dense BSND in
  memory (linear -> view -> transpose, or ``npu_rotary_mul(bsnd).transpose(1, 2)``) the rewrite uses
  ``BSH`` views of them, with no copy; otherwise ``BNSD`` with ``.contiguous()`` (a no-op for the KV
  cache's ``cat`` outputs).

The anchors are ``aten.scaled_dot_product_attention`` (SDPA rows) and the eager chain's
``aten.softmax.int`` (eager rows).

Hybrid models (transformers 5.24 ``Qwen3_5Attention``, ``Qwen3_5MoeAttention``, ``Qwen3NextAttention``): the
full-attention layers' gated attention (``q_proj`` -> query and gate, (1 + w) q/k norms, partial rotary,
then ``attn_output * sigmoid(gate)``) reaches this family as the same rows (q/k are BNSD views of the
partial rotary's BSND output, v of its linear: BSH, no copy); the output gate stays ATen (torch_npu 2.13.0
has no op for it). The linear-attention (Gated DeltaNet) layers hold no softmax attention: 0 expected there.
"""

from __future__ import annotations

import math

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from qwen_npu_compile.compat import guard_or_false
from qwen_npu_compile.fusion.family import (
    CheckDecision,
    CompileTarget,
    PatternVariant,
    current_target,
    meta_val,
    with_parameters,
)
from qwen_npu_compile.ops.attention_contract import compressed_causal_mask, fusion_attention_violation
from qwen_npu_compile.ops.scalars import scalar_argument

from .masks import causal_mask_reason, check_additive_mask, eager_fully_masked_rows, masked_out
from .spellings import _EAGER, _LAYOUT_BNSD, _LAYOUT_BSH, _REPEAT_KV_ENDS, _SDPA, Spelling, _search_fn, row_variant

aten = torch.ops.aten


# --------------------------------------------------------------------------------------------------
# Replace side: one npu_fusion_attention call.
# --------------------------------------------------------------------------------------------------


def _dense_bsnd(t: torch.Tensor) -> bool:
    """True when the ``[B, N, S, D]`` tensor ``t`` is a dense ``[B, S, N, D]`` tensor in memory.

    Decided without guards (``statically_known_true``): an unknown answer means False (BNSD + copy).
    """
    _, heads, slen, head_dim = t.shape
    expected = (slen * heads * head_dim, head_dim, heads * head_dim, 1)
    return all(
        statically_known_true(size == 1) or statically_known_true(stride == want)
        for size, stride, want in zip(t.shape, t.stride(), expected)
    )


def fused_attention(query, key, value, attn_mask=None, *, causal: bool = False, scale: float, dropout_p: float = 0.0):
    """SDPA semantics on ``npu_fusion_attention``: BNSD in, BNSD out, K/V un-repeated (GQA native).

    Args:
        query: ``[B, Nq, Sq, D]``.
        key: ``[B, Nkv, Skv, D]``.
        value: ``[B, Nkv, Skv, Dv]``.
        attn_mask: None, SDPA's bool mask (True = attend) or an additive 0/-inf-like float mask, of a
            shape the op takes (checked by :func:`check_attention`).
        causal: PyTorch's ``is_causal`` (left-up): the compressed mask with ``sparse_mode=2``.
        scale: the softmax scale, passed explicitly (the op's default is 1.0); None is SDPA's 1/sqrt(D).
        dropout_p: dropout probability; ``keep_prob = 1 - dropout_p``.

    Returns:
        ``[B, Nq, Sq, Dv]`` in q's dtype.
    """
    batch, heads, q_len, head_dim = query.shape
    if scale is None:  # SDPA's default (transformers always passes scaling)
        scale = 1.0 / math.sqrt(head_dim)
    options = {"scale": scale, "keep_prob": 1.0 - dropout_p}
    if causal:
        options.update(atten_mask=compressed_causal_mask(query.device), sparse_mode=2)
    elif attn_mask is not None:
        # rows can be fully masked (left padding): only inner_precise=2 computes them correctly
        options.update(atten_mask=masked_out(attn_mask), inner_precise=2)
    if _dense_bsnd(query) and _dense_bsnd(key) and _dense_bsnd(value):
        # BSH views of the linear (or npu_rotary_mul) outputs: no copy in, none out.
        q, k, v = (t.transpose(1, 2).flatten(2) for t in (query, key, value))
        out = torch.ops.npu.npu_fusion_attention.default(q, k, v, heads, _LAYOUT_BSH, **options)[0]
        return out.view(batch, q_len, heads, value.shape[-1]).transpose(1, 2)
    return torch.ops.npu.npu_fusion_attention.default(
        query.contiguous(), key.contiguous(), value.contiguous(), heads, _LAYOUT_BNSD, **options
    )[0]


def _replace_fn(row: Spelling):
    def replace(query, key, value, attn_mask=None, scale=None, dropout_p=0.0):
        query, key, value = _autocast_cast(query, key, value)
        scale = _scale_for(scale)
        if row.impl == _SDPA:
            if CAUSAL_MASK.get():  # the explicit mask is provably causal: not read
                return fused_attention(query, key, value, causal=True, scale=scale, dropout_p=dropout_p)
            causal = row.mask == "causal"
            return fused_attention(query, key, value, attn_mask, causal=causal, scale=scale, dropout_p=dropout_p)
        dropout_p = dropout_p if row.dropout else 0.0
        if CAUSAL_MASK.get():  # provably causal with Sq == Skv: no row is fully masked
            return fused_attention(query, key, value, causal=True, scale=scale, dropout_p=dropout_p)
        out = fused_attention(query, key, value, attn_mask, scale=scale, dropout_p=dropout_p)
        # HF's eager softmax averages V on fully masked rows (left padding); the kernel gives 0 there
        return eager_fully_masked_rows(query, key, value, attn_mask, scale, out)

    return with_parameters(replace, row.parameters)


# --------------------------------------------------------------------------------------------------
# Checks.
# --------------------------------------------------------------------------------------------------


def _equal(a, b) -> bool:
    """``a == b`` for sizes, symbolic ones included: decided on this graph's sizes and guarded.

    The equalities checked with it (k/v lengths, mask vs q/k lengths, repeat_kv sizes) hold whenever
    the original attention runs at all, so the guard never costs a recompile that eager would not fail.
    (``_dense_bsnd`` decides a layout and must not guard: it uses ``statically_known_true``.)
    """
    return guard_or_false(a == b)


def _shape(t: torch.Tensor) -> tuple:
    return tuple(t.shape)


def check_attention(
    query, key, value, attn_mask=None, *, dropout_p=0.0, target: CompileTarget | None = None
) -> str | None:
    """Refusal reason for fusing ``SDPA(query, key, value, attn_mask, dropout_p)`` (FakeTensors), or None.

    The op's limits are :func:`~qwen_npu_compile.ops.torch_npu.fusion_attention.fusion_attention_violation`'s
    (torch_npu 2.13.0 ``npu_fusion_attention`` docs, Meta kernel and torchair GE converter); this adds
    4-D non-empty tensors, a bool or floating mask, and what dropout needs (:func:`_dropout_reason`).

    Args:
        query: ``[B, Nq, Sq, D]``.
        key: ``[B, Nkv, Skv, D]``, un-repeated.
        value: ``[B, Nkv, Skv, Dv]``.
        attn_mask: None, or the SDPA/eager mask (bool, or a float mask already verified by
            :func:`.masks.check_additive_mask`).
        dropout_p: the effective dropout probability (0 in eval); a non-constant one is refused.
        target: where the rewritten graph goes (``fusion.current_target()``); None = unknown.
    """
    tensors = {"query": query, "key": key, "value": value}
    if not all(isinstance(t, torch.Tensor) for t in tensors.values()):
        return "query, key or value is not a tensor"
    if any(t.dim() != 4 for t in tensors.values()):
        return f"q/k/v must be 4-D [B, N, S, D], got {[_shape(t) for t in tensors.values()]}"
    if any(statically_known_true(t.numel() == 0) for t in tensors.values()):
        return "empty query, key or value"
    if attn_mask is not None:
        if not isinstance(attn_mask, torch.Tensor):
            return "attention mask is not a tensor"
        if attn_mask.dtype != torch.bool and not attn_mask.dtype.is_floating_point:
            return f"attention mask dtype {attn_mask.dtype}: expected SDPA's bool mask or an additive float mask"
    keep_prob = _keep_prob(dropout_p)
    # The op's own limits (kernel + torchair GE converter), with the layout the rewrite may pick: BSH and
    # BNSD are both GE layouts, so the layout never decides a refusal here.
    reason = fusion_attention_violation(
        _shape(query), _shape(key), _shape(value), (query.dtype, key.dtype, value.dtype),
        input_layout=_LAYOUT_BNSD,
        mask_shape=_shape(attn_mask) if attn_mask is not None else None,
        keep_prob=keep_prob if keep_prob is not None else 1.0,
        downstream=target.downstream if target is not None else None,
    )
    if reason is not None:
        return reason
    return _dropout_reason(dropout_p, target)


def _keep_prob(dropout_p) -> float | None:
    """``1 - dropout_p`` for a constant probability in [0, 1), else None (refused by :func:`_dropout_reason`)."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0 <= dropout_p < 1:
        return None
    return 1.0 - dropout_p


def _dropout_reason(dropout_p, target: CompileTarget | None) -> str | None:
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)):
        return f"dropout probability {dropout_p!r} is not a compile-time constant; keep_prob cannot be checked"
    if dropout_p == 0:
        return None
    if not 0 < dropout_p < 1:
        return f"dropout_p={dropout_p} outside [0, 1): keep_prob must lie in (0, 1]"
    keep = f"dropout_p={dropout_p} (keep_prob {1 - dropout_p:g})"
    if target is None:
        return f"{keep} and no known downstream backend: torchair's GE converter takes keep_prob == 1 only"
    if target.simulated:
        return (
            f"{keep}: the simulated npu_fusion_attention draws its dropout mask from fixed seed/offset (0, 0), "
            "so every layer and step would drop the same positions; fusing would silently make training "
            "dropout deterministic (the real kernel draws a fresh Philox seed per call)"
        )
    return None


def _is_repeated(node) -> bool:
    """True when ``node`` is the end of a repeat_kv-like ``expand -> reshape`` chain."""
    return (
        isinstance(node, torch.fx.Node)
        and node.target in _REPEAT_KV_ENDS
        and isinstance(node.args[0], torch.fx.Node)
        and node.args[0].target is aten.expand.default
    )


def _repeat_kv_reason(match, heads: int) -> str | None:
    """Check the swallowed repeat_kv chains by shape (their size lists are not part of the pattern).

    ``[B, Nkv, 1, S, D] -expand-> [B, Nkv, n_rep, S, D] -reshape-> [B, Nkv*n_rep, S, D]`` with
    n_rep = Nq / Nkv is exactly HF's repeat_kv: query head h then reads KV head h // n_rep, which is the
    kernel's GQA mapping. (A reshape's element order is fixed by its input and output shapes.)
    """
    for node in match.nodes:
        if node.target is not aten.expand.default:
            continue
        source, expanded = meta_val(node.args[0]), meta_val(node)
        reshaped = meta_val(next(iter(node.users)))
        batch, kv_heads, one, slen, head_dim = source.shape
        if heads % kv_heads != 0:
            return f"Nq={heads} is not a multiple of Nkv={kv_heads}"
        n_rep = heads // kv_heads
        wanted = {"expand": (batch, kv_heads, n_rep, slen, head_dim), "reshape": (batch, heads, slen, head_dim)}
        for label, value in (("expand", expanded), ("reshape", reshaped)):
            shape = _shape(value)
            if _equal(one, 1) and len(shape) == len(wanted[label]) and all(
                _equal(size, want) for size, want in zip(shape, wanted[label])
            ):
                continue
            return f"repeat_kv {label} {node.name} gives {shape}, not {wanted[label]} (n_rep={n_rep})"
    return None


#: Decided by a variant's check when it accepts a match whose scale is a constant one-element tensor: the
#: Python float read from it (``npu_fusion_attention``'s ``float scale``); None = pass the bound scale.
SCALE: CheckDecision[float | None] = CheckDecision("attention_scale", default=None)


def _scale_reason(match) -> str | None:
    """Refusal reason when the matched scale cannot be ``npu_fusion_attention``'s ``float scale``
    (:func:`~qwen_npu_compile.ops.scalars.scalar_argument`: a per-head tensor, a 0-d graph input);
    else None, with :data:`SCALE` set for the replacement."""
    value, reason = scalar_argument("npu_fusion_attention", "scale", match.kwargs.get("scale"), allow_none=True)
    if reason is not None:
        return reason
    SCALE.decide(value if value is not match.kwargs.get("scale") else None)
    return None


def _scale_for(bound):
    """The scale the replacement passes: the constant the check read, else the matched value."""
    constant = SCALE.get()
    return bound if constant is None else constant


#: Decided by a variant's check when q/k/v have different dtypes that autocast reconciled (fp32 q/k from the
#: rotary, bf16 v from an autocast linear): autocast's dtype, which the replacement casts q, k, v to.
AUTOCAST_DTYPE: CheckDecision[torch.dtype | None] = CheckDecision("attention_autocast_dtype", default=None)
_HALF_DTYPES = (torch.float16, torch.bfloat16)


def _autocast_dtype(match, q, k, v) -> tuple[torch.dtype | None, str | None]:
    """``(dtype, None)`` when the graph proves autocast cast q, k, v to ``dtype``; ``(None, None)`` when
    they already agree; ``(None, reason)`` for mixed dtypes it does not explain.

    Under ``torch.autocast(dtype=D)`` the pre-dispatch graph keeps the ops' original (mixed) inputs and
    records autocast's output dtype: CPU and CUDA autocast run ``scaled_dot_product_attention`` and
    ``matmul`` in D with every fp32 input cast to D (``lower_precision_fp`` in aten/src/ATen/autocast_mode.cpp).
    So SDPA giving D from mixed q/k/v, or the eager chain whose two matmuls both give D, is attention over
    ``q.to(D), k.to(D), v.to(D)``; the fused op gets exactly those casts. (The eager chain also rounds the
    scores and probabilities to D between its ops, the kernel does not: the half-precision bound.)
    """
    dtypes = (q.dtype, k.dtype, v.dtype)
    if len(set(dtypes)) == 1:
        return None, None
    ends = [n for n in match.nodes if n.target in (aten.scaled_dot_product_attention.default, aten.matmul.default)]
    outs = {getattr(meta_val(n), "dtype", None) for n in ends}
    dtype = next(iter(outs)) if len(outs) == 1 else None
    if not ends or dtype not in _HALF_DTYPES or not all(d in (torch.float32, dtype) for d in dtypes):
        return None, (
            f"dtype mismatch: query/key/value dtypes differ {dtypes} and the attention's ops do not all give one "
            f"half dtype (got {sorted(map(str, outs))}), so no autocast cast explains them; the kernel takes one dtype"
        )
    return dtype, None


#: Decided by a variant's check: True when the matched explicit mask is provably the plain causal mask
#: (:func:`.masks.causal_mask_reason`); the replacement then uses ``sparse_mode=2`` with the
#: compressed mask and leaves the ``[B, 1, S, S]`` mask unread (it becomes dead code).
CAUSAL_MASK: CheckDecision[bool] = CheckDecision("attention_causal_mask", default=False)
#: Every decision an attention variant's check makes and its replacement reads.
DECISIONS = (SCALE, AUTOCAST_DTYPE, CAUSAL_MASK)


def _plain_causal(query, key, mask_node: torch.fx.Node) -> bool:
    """Whether the explicit mask of an attention over ``query [B, Nq, Sq, D]`` and ``key [B, Nkv, Skv, D]``
    is provably the plain causal mask with Sq == Skv (static sizes), so ``sparse_mode=2`` is exact."""
    if causal_mask_reason(mask_node) is not None:  # the reason is logged there (debug)
        return False
    q_len, kv_len = query.shape[2], key.shape[2]
    return isinstance(q_len, int) and q_len == kv_len == meta_val(mask_node).shape[-1]


def _autocast_cast(*tensors):
    """q, k, v in the dtype autocast gives them (:data:`AUTOCAST_DTYPE`), else unchanged."""
    dtype = AUTOCAST_DTYPE.get()
    return tensors if dtype is None else tuple(t.to(dtype) for t in tensors)


def _check_fn(row: Spelling):
    """The check of one row's variant: scale, autocast dtypes, repeated K/V, the op's contract, the mask."""

    def check(match) -> str | None:
        scale_reason = _scale_reason(match)
        if scale_reason is not None:
            return scale_reason
        q, k, v = (meta_val(match.kwargs[name]) for name in ("query", "key", "value"))
        if all(isinstance(t, torch.Tensor) for t in (q, k, v)):
            cast_dtype, cast_reason = _autocast_dtype(match, q, k, v)
            if cast_reason is not None:
                return cast_reason
            AUTOCAST_DTYPE.decide(cast_dtype)
            if cast_dtype is not None:
                q, k, v = (t.to(cast_dtype) for t in (q, k, v))
        mask_node = match.kwargs.get("attn_mask")
        dropout_p = meta_val(match.kwargs.get("dropout_p", 0.0))
        if row.impl == _EAGER and not row.dropout:
            dropout_p = 0.0  # F.dropout(training=False) is the identity whatever p
        if row.kv == "mha" and (_is_repeated(match.kwargs["key"]) or _is_repeated(match.kwargs["value"])):
            return (
                "key/value come from an expand+reshape (a repeat_kv form no GQA variant recognised); "
                "fusing it would pass repeated K/V instead of using the kernel's native GQA"
            )
        mask = meta_val(mask_node) if mask_node is not None else None
        reason = check_attention(q, k, v, mask, dropout_p=dropout_p, target=current_target())
        if reason is None and row.kv.startswith("repeat_kv"):
            reason = _repeat_kv_reason(match, q.shape[1])
        if reason is None and isinstance(mask, torch.Tensor) and mask.dtype != torch.bool:
            reason = check_additive_mask(mask_node)
        # last (it may evaluate the mask): an explicit mask that is provably the plain causal one
        CAUSAL_MASK.decide(reason is None and isinstance(mask_node, torch.fx.Node) and _plain_causal(q, k, mask_node))
        return reason

    return check


def _variant(row: Spelling) -> PatternVariant:
    """The :class:`~qwen_npu_compile.fusion.family.PatternVariant` of one table row (its exact pattern traced here)."""
    return row_variant(row, name=row.name, parameters=row.parameters, search_fn=_search_fn(row),
                       replace_fn=_replace_fn(row), check=_check_fn(row), why=row.why, decides=DECISIONS)
