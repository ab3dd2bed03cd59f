"""Attention (SDPA and the eager chain) -> ``npu_fusion_attention``.

Mirrors transformers 5.x (checked on 5.24.0) ``integrations/sdpa_attention.py`` and
``models/qwen2/modeling_qwen2.py``::

    def repeat_kv(hidden_states, n_rep):                       # both attention paths
        batch, num_key_value_heads, slen, head_dim = hidden_states.shape
        if n_rep == 1:
            return hidden_states
        hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
        return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)

    def sdpa_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, ...):
        if module.num_key_value_groups > 1:
            if use_gqa_in_sdpa(attention_mask, key, value):    # no mask and head_dim <= 256
                sdpa_kwargs["enable_gqa"] = True
            else:                                             # (pack_gqa only when not compiling)
                key, value = repeat_kv(key, n_rep), repeat_kv(value, n_rep)
        is_causal = q_length > 1 and attention_mask is None and is_causal
        attn_output = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
            dropout_p=dropout, scale=scaling, is_causal=is_causal, **sdpa_kwargs)

    def eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        key_states, value_states = repeat_kv(key, n_rep), repeat_kv(value, n_rep)
        attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask
        attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
        attn_weights = nn.functional.dropout(attn_weights, p=dropout, training=module.training)
        attn_output = torch.matmul(attn_weights, value_states)
        return attn_output.transpose(1, 2).contiguous(), attn_weights

What captured Qwen2 graphs hold (torch 2.13, transformers 5.24; q is ``rotary(linear.view.transpose)``,
BNSD shape over BSND memory; dropout is ``attention_dropout`` in training, else 0):

1. SDPA, no KV cache, with or without ``attention_mask``: an explicit bool mask ``[B,1,S,S]`` (True =
   attend) is built once per forward, from the padding mask or (5.x) from position_ids' packed-sequence
   detection, and shared by every layer; repeat_kv on k and v; ``is_causal=False``.
2. SDPA with ``use_cache=True`` (DynamicCache) and no padding: prefill ``attn_mask=None, is_causal=True,
   enable_gqa=True``, decode (q_len 1) ``attn_mask=None, is_causal=False, enable_gqa=True``; no repeat_kv.
   With padding the cache graphs are shape 1 with k/v from the cache's ``cat``.
3. Eager: the chain above with the additive mask ``where(bool_mask, 0, finfo(dtype).min)`` (shared),
   ``aten.dropout`` always present (``train=False`` in eval), and no ``to`` cast in fp32 (a no-op, removed).

Under ``dynamic=True`` repeat_kv's ``[:, :, None]`` indexing leaves full ``aten.slice`` nodes on the
symbolic dims: the one on dim 0 precedes the unsqueeze (it is the pattern's k/v input, a no-op view), the
one on dim 3 (S) sits inside repeat_kv and gets its own variants. With n_rep == 1 (MHA) there is no
repeat_kv at all. (N and D come from the config and stay static in model graphs; a hand-made graph with
symbolic head counts or head dims has slices on those dims too and is refused with a reason.)

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
:func:`~qwen_npu_compile.npu_ops.fusion_attention.compressed_causal_mask`; 4 MiB per layer, saved for
backward) with ``sparse_mode=2``; the eager chain gets ``atten_mask = mask != 0``. Inputs that are not all
dense BSND (the KV cache's ``cat`` outputs are BNSD-contiguous) take ``'BNSD'`` and ``.contiguous()``.

Constraints (``shared/reference/npu-op-contracts.md``; torch_npu 2.13.0 ``npu_fusion_attention`` docs,
Meta kernel and torchair GE converter; :mod:`qwen_npu_compile.npu_ops.fusion_attention`):

- q, k, v one dtype, fp16/bf16/fp32; Dq == Dk <= 768 (``MAX_HEAD_DIM``), Dv <= Dk; Nq <= 256;
  ``head_num`` = Nq and Nq % Nkv == 0 (native GQA: query head h reads kv head h // n_rep, which is what
  repeat_kv builds; n_rep is taken from the shapes and re-checked against the matched expand).
- ``atten_mask`` is bool with **True = masked out**: SDPA's bool mask (True = attend) becomes
  ``logical_not(mask)``; an additive float mask becomes ``mask != 0``, which is exact only for HF's
  ``where(bool, 0, finfo.min | -inf)``: any other float mask is refused (:func:`check_additive_mask`).
  Mask shapes BNSS, B1SS, 11SS, SS only. ``is_causal`` (left-up, as in PyTorch) is ``sparse_mode=2``
  with the 2048x2048 compressed mask. ``scale`` defaults to 1.0 in the op: always passed explicitly.
- ``inner_precise=2`` with an explicit mask: left padding masks whole query rows, which only mode 2
  computes correctly. Such rows give 0, as PyTorch SDPA (>= 2.5) gives; HF's *eager* chain gives the mean
  of V there instead (``finfo.min`` absorbs the scores, the softmax is uniform), and its gradient still
  reaches q and k, so the fused eager chain replaces those rows by exactly that
  (:func:`eager_fully_masked_rows`: a linearised term summed as ``q(KᵀV)``, no second S×S attention).
- ``keep_prob = 1 - dropout_p``. torchair's GE converter takes ``keep_prob == 1`` only and BSH/BNSD
  layouts only: dropout is refused when the downstream is torchair. The GE op FlashAttentionScore takes
  fp16/bf16 q/k/v only, so fp32 attention is refused for torchair too (the aclnn kernel that eager
  torch_npu and the other downstreams call takes fp32, so they still fuse it). Every limit of the op
  lives in :func:`~qwen_npu_compile.npu_ops.fusion_attention.fusion_attention_violation`. It is refused too when the ops are
  the simulated stand-ins, whose dropout mask is a fixed function of (shape, seed=0, offset=0): every
  layer and every step would drop the same positions, silently making training dropout deterministic
  (the real kernel draws a fresh Philox seed per call). Only real ops with a non-GE downstream fuse it.
- The kernel needs contiguous inputs (vllm-ascend #2388, #11834): when q, k and v are all dense BSND in
  memory (linear -> view -> transpose, or ``npu_rotary_mul(bsnd).transpose(1, 2)``) the rewrite uses
  ``BSH`` views of them, with no copy; otherwise ``BNSD`` with ``.contiguous()`` (a no-op for the KV
  cache's ``cat`` outputs).

The anchors are ``aten.scaled_dot_product_attention`` and the eager chain's ``aten.softmax.int``.
"""

from __future__ import annotations

import contextvars
import inspect
import math
import sys

import torch
import torch.fx
from torch._inductor import pattern_matcher as pm
from torch.fx.experimental.symbolic_shapes import statically_known_true

from qwen_npu_compile.canonicalize import trace_pattern
from qwen_npu_compile.compat import guard_or_false
from qwen_npu_compile.fusion import (
    CompileTarget,
    FamilyPass,
    FusionFamily,
    PatternVariant,
    current_target,
    meta_val,
    node_source,
)
from qwen_npu_compile.npu_ops.fusion_attention import GE_LAYOUTS, compressed_causal_mask, fusion_attention_violation
from qwen_npu_compile.npu_ops.scalars import constant_tensor_value, scalar_argument

aten = torch.ops.aten
F = torch.nn.functional

#: The end of a full ``aten.slice`` (what ``x[:, :, None, :, :]`` leaves on a symbolic dim).
_SLICE_END = sys.maxsize
#: Magic values standing for the module floats while tracing (replaced by wildcards in the pattern).
_SCALE, _DROPOUT_P = 0.171717, 0.113377
#: The only two layouts torchair's GE converter accepts; BSH when q, k, v are dense BSND in memory.
_LAYOUT_BSH, _LAYOUT_BNSD = "BSH", "BNSD"
assert {_LAYOUT_BSH, _LAYOUT_BNSD} == set(GE_LAYOUTS)
#: Ops that keep the set of values of an additive mask (views, copies, casts) between it and its where.
_VALUE_PRESERVING = (
    aten.alias.default, aten.clone.default, aten.contiguous.default, aten.expand.default, aten.reshape.default,
    aten.slice.Tensor, aten.to.dtype, aten.unsqueeze.default, aten.view.default, aten._to_copy.default,
)  # fmt: skip
_WHERE_OPS = (aten.where.self, aten.where.ScalarOther, aten.where.ScalarSelf, aten.where.Scalar)
_ZERO_FACTORIES = (aten.zeros.default, aten.zeros_like.default, aten.new_zeros.default)
#: Constant-filled tensor factories -> the position of their fill value.
_FULL_FACTORIES = {
    aten.full.default: 1, aten.full_like.default: 1, aten.new_full.default: 2, aten.scalar_tensor.default: 0,
}  # fmt: skip
_REPEAT_KV_ENDS = (aten.reshape.default, aten.view.default, aten._unsafe_view.default)

#: How k/v reach the attention; each needs its own variant (``why`` in :meth:`AttentionFamily.iter_variants`).
KV_FORMS = {
    "repeat_kv": "repeat_kv (unsqueeze/expand/reshape) on k and v, static S: swallowed, K/V passed un-repeated",
    "repeat_kv_symbolic": "repeat_kv under a symbolic S, where [:, :, None] leaves a full slice on dim 3",
    "gqa": "enable_gqa=True: transformers skips repeat_kv when there is no mask (use_gqa_in_sdpa)",
    "mha": "Nq == Nkv: repeat_kv returns its input (registered last; refuses repeated K/V)",
}
#: The SDPA mask arguments transformers passes.
SDPA_MASKS = {
    "mask": "an explicit mask (bool; float if verified), is_causal=False: no cache, or padding",
    "causal": "attn_mask=None, is_causal=True: prefill with a KV cache and no padding",
    "none": "attn_mask=None, is_causal=False: decode (q_len 1) with a KV cache and no padding",
}


# --------------------------------------------------------------------------------------------------
# Search side: the subgraphs as transformers computes them.
# --------------------------------------------------------------------------------------------------


def _repeat_kv(x, n_rep: int, symbolic: bool):
    """HF ``repeat_kv`` spelled with explicit ATen ops, so that tracing never adds or drops slices."""
    batch, heads, slen, head_dim = x.shape
    x = x.unsqueeze(2)
    if symbolic:
        x = aten.slice.Tensor(x, 3, 0, _SLICE_END)
    x = x.expand(batch, heads, n_rep, slen, head_dim)
    return x.reshape(batch, heads * n_rep, slen, head_dim)


def _searched_kv(query, key, value, kv: str):
    if kv.startswith("repeat_kv"):
        n_rep = query.shape[1] // key.shape[1]  # re-checked: the matched expand must have this size
        symbolic = kv == "repeat_kv_symbolic"
        return _repeat_kv(key, n_rep, symbolic), _repeat_kv(value, n_rep, symbolic)
    return key, value


def _sdpa(query, key, value, attn_mask, scale, dropout_p, *, kv: str, causal: bool):
    key, value = _searched_kv(query, key, value, kv)
    extra = {"enable_gqa": True} if kv == "gqa" else {}  # as sdpa_attention_forward passes it
    return F.scaled_dot_product_attention(
        query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, scale=scale, is_causal=causal, **extra
    )


def _eager(query, key, value, attn_mask, scale, dropout_p, *, kv: str, train: bool):
    key, value = _searched_kv(query, key, value, kv)
    attn_weights = torch.matmul(query, key.transpose(2, 3)) * scale
    attn_weights = attn_weights + attn_mask
    attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
    attn_weights = F.dropout(attn_weights, p=dropout_p, training=train)
    return torch.matmul(attn_weights, value)


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
        masked_out = torch.logical_not(attn_mask) if attn_mask.dtype == torch.bool else attn_mask != 0
        # rows can be fully masked (left padding): only inner_precise=2 computes them correctly
        options.update(atten_mask=masked_out.contiguous(), inner_precise=2)
    if _dense_bsnd(query) and _dense_bsnd(key) and _dense_bsnd(value):
        # BSH views of the linear (or npu_rotary_mul) outputs: no copy in, none out.
        q, k, v = (t.transpose(1, 2).flatten(2) for t in (query, key, value))
        out = torch.ops.npu.npu_fusion_attention.default(q, k, v, heads, _LAYOUT_BSH, **options)[0]
        return out.view(batch, q_len, heads, value.shape[-1]).transpose(1, 2)
    return torch.ops.npu.npu_fusion_attention.default(
        query.contiguous(), key.contiguous(), value.contiguous(), heads, _LAYOUT_BNSD, **options
    )[0]


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

    Args:
        query: ``[B, Nq, Sq, D]``.
        key: ``[B, Nkv, Skv, D]``, un-repeated.
        value: ``[B, Nkv, Skv, Dv]``.
        attn_mask: None, or the SDPA/eager mask (bool, or a float mask already verified by
            :func:`check_additive_mask`).
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


def _constant(arg) -> float | None:
    """The value of a where() branch that is a literal or a constant-filled tensor, else None."""
    if isinstance(arg, (int, float)) and not isinstance(arg, bool):
        return float(arg)
    if not isinstance(arg, torch.fx.Node):
        return None
    # transformers 4.5x eager_mask: where(mask, torch.tensor(0.0), min); make_fx keeps the real scalar
    # as a get_attr constant behind lift_fresh_copy / detach_.
    constant = constant_tensor_value(arg)
    if constant is not None:
        return constant
    if arg.op != "call_function":
        return None
    if arg.target in _ZERO_FACTORIES:
        return 0.0
    if arg.target in _FULL_FACTORIES:
        index = _FULL_FACTORIES[arg.target]
        value = arg.args[index] if len(arg.args) > index else arg.kwargs.get("fill_value", arg.kwargs.get("s"))
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
    return None


def _masks_exactly(value: float) -> bool:
    """-inf or a dtype's finfo.min: exp(value + score - row max) is exactly 0 in the fp32 softmax."""
    finfo_mins = {torch.finfo(dtype).min for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64)}
    return value == -math.inf or value in finfo_mins


def check_additive_mask(mask: torch.fx.Node) -> str | None:
    """Refusal reason for converting the float mask ``mask`` to ``mask != 0`` (True = masked out), or None.

    Exact only when every value is 0 or masks completely: the mask must come (through views, copies and
    casts) from ``where(bool, 0, m)`` or ``where(bool, m, 0)`` with m = -inf or a finfo.min, which is how
    transformers' ``eager_mask`` builds it. A mask that is a graph input, or holds a bias (ALiBi, T5),
    cannot be proven so and is refused.
    """
    node = mask
    while isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in _VALUE_PRESERVING:
        node = node.args[0]
    if not isinstance(node, torch.fx.Node):
        return f"additive mask is the constant {node!r}"
    if node.op != "call_function" or node.target not in _WHERE_OPS:
        producer = "a graph input" if node.op == "placeholder" else str(node.target)
        return (
            f"additive float mask comes from {producer} ({node.name}), not where(bool, 0, finfo.min): its "
            "values cannot be proven to be 0 or fully masking, so no exact boolean mask exists"
        )
    condition = meta_val(node.args[0])
    branches = sorted((_constant(node.args[1]), _constant(node.args[2])), key=lambda v: (v is None, v != 0))
    if not isinstance(condition, torch.Tensor) or condition.dtype != torch.bool:
        return f"additive mask {node.name}: where() condition is not a bool tensor"
    zero, other = branches
    if zero != 0 or other is None or not _masks_exactly(other):
        return (
            f"additive mask {node.name} = where(cond, {node.args[1]}, {node.args[2]}) holds values other than "
            "0 and -inf/finfo.min; mask != 0 would not be exact"
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


#: Set by a variant's check when it accepts a match whose scale is a constant one-element tensor: the
#: Python float read from it (``npu_fusion_attention``'s ``float scale``); None = pass the bound scale.
#: Read by the replacement, which Inductor traces right after the check accepts.
_SCALE_CONSTANT: contextvars.ContextVar[float | None] = contextvars.ContextVar("qwen_npu_attention_scale", default=None)


def _scale_reason(match) -> str | None:
    """Refusal reason when the matched scale cannot be ``npu_fusion_attention``'s ``float scale``
    (:func:`~qwen_npu_compile.npu_ops.scalars.scalar_argument`: a per-head tensor, a 0-d graph input);
    else None, with :data:`_SCALE_CONSTANT` set for the replacement."""
    value, reason = scalar_argument("npu_fusion_attention", "scale", match.kwargs.get("scale"), allow_none=True)
    if reason is not None:
        return reason
    _SCALE_CONSTANT.set(value if value is not match.kwargs.get("scale") else None)
    return None


#: Set by a variant's check when q/k/v have different dtypes that autocast reconciled (fp32 q/k from the
#: rotary, bf16 v from an autocast linear): autocast's dtype, which the replacement casts q, k, v to.
_AUTOCAST_DTYPE: contextvars.ContextVar[torch.dtype | None] = contextvars.ContextVar(
    "qwen_npu_attention_autocast", default=None
)
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


def _autocast_cast(*tensors):
    """q, k, v in the dtype autocast gives them (:data:`_AUTOCAST_DTYPE`), else unchanged."""
    dtype = _AUTOCAST_DTYPE.get()
    return tensors if dtype is None else tuple(t.to(dtype) for t in tensors)


def _scale_for(bound):
    """The scale the replacement passes: the constant the check read, else the matched value."""
    constant = _SCALE_CONSTANT.get()
    return bound if constant is None else constant


def _make_check(kv: str, eager_train: bool | None):
    """The check of one variant; ``eager_train`` is None for SDPA variants, else the dropout's ``train``."""

    def check(match) -> str | None:
        scale_reason = _scale_reason(match)
        if scale_reason is not None:
            return scale_reason
        q, k, v = (meta_val(match.kwargs[name]) for name in ("query", "key", "value"))
        if all(isinstance(t, torch.Tensor) for t in (q, k, v)):
            cast_dtype, cast_reason = _autocast_dtype(match, q, k, v)
            if cast_reason is not None:
                return cast_reason
            _AUTOCAST_DTYPE.set(cast_dtype)
            if cast_dtype is not None:
                q, k, v = (t.to(cast_dtype) for t in (q, k, v))
        mask_node = match.kwargs.get("attn_mask")
        dropout_p = meta_val(match.kwargs.get("dropout_p", 0.0))
        if eager_train is False:
            dropout_p = 0.0  # F.dropout(training=False) is the identity whatever p
        if kv == "mha" and (_is_repeated(match.kwargs["key"]) or _is_repeated(match.kwargs["value"])):
            return (
                "key/value come from an expand+reshape (a repeat_kv form no GQA variant recognised); "
                "fusing it would pass repeated K/V instead of using the kernel's native GQA"
            )
        mask = meta_val(mask_node) if mask_node is not None else None
        reason = check_attention(q, k, v, mask, dropout_p=dropout_p, target=current_target())
        if reason is None and kv.startswith("repeat_kv"):
            reason = _repeat_kv_reason(match, q.shape[1])
        if reason is None and isinstance(mask, torch.Tensor) and mask.dtype != torch.bool:
            reason = check_additive_mask(mask_node)
        return reason

    return check


# --------------------------------------------------------------------------------------------------
# Variants.
# --------------------------------------------------------------------------------------------------


def _sdpa_functions(kv: str, mask: str, dropout: bool):
    """``(search_fn, replace_fn)`` with exactly the parameters the match binds (an unused one breaks it)."""
    causal = mask == "causal"

    def search(query, key, value, attn_mask, scale, dropout_p):
        return _sdpa(query, key, value, attn_mask, scale, dropout_p, kv=kv, causal=causal)

    def replace(query, key, value, attn_mask, scale, dropout_p):
        query, key, value = _autocast_cast(query, key, value)
        return fused_attention(
            query, key, value, attn_mask, causal=causal, scale=_scale_for(scale), dropout_p=dropout_p
        )

    if mask == "mask" and dropout:
        return search, replace
    if mask == "mask":

        def search_masked(query, key, value, attn_mask, scale):
            return search(query, key, value, attn_mask, scale, 0.0)

        def replace_masked(query, key, value, attn_mask, scale):
            return replace(query, key, value, attn_mask, scale, 0.0)

        return search_masked, replace_masked
    if dropout:

        def search_unmasked_dropout(query, key, value, scale, dropout_p):
            return search(query, key, value, None, scale, dropout_p)

        def replace_unmasked_dropout(query, key, value, scale, dropout_p):
            return replace(query, key, value, None, scale, dropout_p)

        return search_unmasked_dropout, replace_unmasked_dropout

    def search_unmasked(query, key, value, scale):
        return search(query, key, value, None, scale, 0.0)

    def replace_unmasked(query, key, value, scale):
        return replace(query, key, value, None, scale, 0.0)

    return search_unmasked, replace_unmasked


def eager_fully_masked_rows(query, key, value, attn_mask, scale, out):
    """``out`` with every fully masked query row replaced by what HF's eager chain computes there.

    On a row where every key is masked (left padding), ``scores + finfo.min`` is ``finfo.min`` for every
    key (the scores are absorbed), so eager's fp32 softmax is exactly uniform and the row is the mean of
    V, where ``npu_fusion_attention`` (like SDPA) gives 0. The gradient of that row in eager is the
    softmax Jacobian at the uniform point, ``dS_j = (g·v_j - mean_k g·v_k) / S``, which still reaches q
    and k (``+ mask`` passes the gradient through). With ``e(x) = x - x.detach()`` (value exactly 0), the
    row equals ``mean(V) + scale/S · (q(KᵀV) - q̂(K̂ᵀV) - e(q·mean(K))·ΣV)`` in value and first
    derivative: the linearised softmax, summed with ``KᵀV`` first, so it costs two ``[D, Dv]`` products
    per query row instead of a second ``S×S`` attention. GQA: query head h reads KV head ``h // n_rep``.

    Args:
        query: ``[B, Nq, Sq, D]``; key ``[B, Nkv, Skv, D]``; value ``[B, Nkv, Skv, Dv]`` (un-repeated).
        attn_mask: eager's additive mask (0 = attend), ``[B|1, 1|Nq, Sq, Skv]``.
        scale: the scores' scale.
        out: the fused attention, ``[B, Nq, Sq, Dv]``.

    Returns:
        ``[B, Nq, Sq, Dv]`` in ``out``'s dtype (computed in fp32).
    """
    batch, heads = query.shape[:2]
    kv_heads = key.shape[1]
    # Written for torchair: only ops it converts (aten.all.dim and amax have stub GE converters in
    # torch_npu 2.13.0), no Python arithmetic on the symbolic key length, and no view that mixes the
    # sequence length with another dim (torchair's optimize_view compares view dims, which pinned a
    # dynamic S to 64 when S happened to equal D). The additive mask is 0 or finfo.min, so a row is
    # fully masked when its maximum is not 0; 1/S comes from a tensor count; GQA repeats the small
    # [D, Dv] / [1, D] / [1, Dv] summaries per query head, never q.
    fully_masked = torch.max(attn_mask, dim=-1, keepdim=True).values != 0  # [B|1, 1|Nq, Sq, 1]
    k, v = key.float(), value.float()

    def per_query_head(t):  # [B, Nkv, a, b] -> [B, Nq, a, b], query head h reads KV head h // n_rep
        return t[:, :, None].expand(batch, kv_heads, heads // kv_heads, *t.shape[2:]).reshape(batch, heads, *t.shape[2:])

    q = query.float()
    kv_len = per_query_head(torch.ones_like(v[..., :1]).sum(dim=-2, keepdim=True))  # [B, Nq, 1, 1]: S
    k_t_v = per_query_head(k.transpose(-2, -1) @ v)  # [B, Nq, D, Dv]
    k_t_v_detached = per_query_head(k.detach().transpose(-2, -1) @ v)
    linear = q @ k_t_v - q.detach() @ k_t_v_detached
    q_k_mean = (q * per_query_head(k.mean(dim=-2, keepdim=True))).sum(dim=-1, keepdim=True)  # [B, Nq, Sq, 1]
    v_sum = per_query_head(v.sum(dim=-2, keepdim=True))  # [B, Nq, 1, Dv]
    rows = ((v_sum + scale * (linear - (q_k_mean - q_k_mean.detach()) * v_sum)) / kv_len).to(out.dtype)
    return torch.where(fully_masked, rows, out)


def _eager_functions(kv: str, train: bool):
    def search(query, key, value, attn_mask, scale, dropout_p):
        return _eager(query, key, value, attn_mask, scale, dropout_p, kv=kv, train=train)

    def replace(query, key, value, attn_mask, scale, dropout_p):
        query, key, value = _autocast_cast(query, key, value)
        out = fused_attention(
            query, key, value, attn_mask, scale=_scale_for(scale), dropout_p=dropout_p if train else 0.0
        )
        # HF's eager softmax averages V on fully masked rows (left padding); the kernel gives 0 there
        return eager_fully_masked_rows(query, key, value, attn_mask, _scale_for(scale), out)

    return search, replace


def _examples(kv: str, dtype: torch.dtype, mask: torch.dtype | None, dropout: bool):
    """q [2, 4, 8, 16]; k/v with 2 KV heads (4 for MHA); a [2, 1, 8, 8] mask; the magic scalars."""
    kv_heads = 4 if kv == "mha" else 2

    def build():
        tensors = [torch.empty(2, 4, 8, 16, dtype=dtype)]
        tensors += [torch.empty(2, kv_heads, 8, 16, dtype=dtype), torch.empty(2, kv_heads, 8, 16, dtype=dtype)]
        if mask is not None:
            tensors.append(torch.zeros(2, 1, 8, 8, dtype=mask))
        return tensors + ([_SCALE, _DROPOUT_P] if dropout else [_SCALE])

    return build


def _exact_pattern(search_fn, example_inputs, scalar_workaround) -> pm.PatternExpr:
    """The pattern of ``search_fn``, exact in every literal except size lists.

    Inductor would match a first pattern that ignores all ints, floats, dtypes and lists, then re-trace
    ``search_fn`` with the match's shapes for the exact comparison; under ``dynamic=True`` that re-trace
    binds only one of the independent symbolic sizes (B and S here) as an input and spells the other
    ``sym_size(key, 2)``, which never equals the graph's SymInt placeholder inside repeat_kv's
    expand/reshape size lists. So the variants carry their exact pattern, with only lists (those size
    lists) left as wildcards; :func:`_repeat_kv_reason` checks them by shape instead.
    """
    argnames = list(inspect.signature(search_fn).parameters)
    gm = trace_pattern(search_fn, list(example_inputs))
    lists = (list, torch.fx.immutable_collections.immutable_list)  # FX stores node arguments' lists as the latter
    return pm.fx_to_pattern(gm, ignore_types=lists, argnames=argnames, scalar_workaround=scalar_workaround)


def _variant(name, search_fn, replace_fn, examples, check, scalar_workaround, why) -> PatternVariant:
    return PatternVariant(
        name=name,
        search_fn=search_fn,
        replace_fn=replace_fn,
        example_inputs=examples,
        check=check,
        scalar_workaround=scalar_workaround,
        why=why,
        # built at registration: a variant no graph needs is never traced (FamilyPass registers lazily)
        search_fn_pattern=lambda: _exact_pattern(search_fn, examples(), scalar_workaround),
        # SDPA variants need SDPA in the graph; eager ones the softmax of eager_attention_forward
        anchor_ops=(aten.scaled_dot_product_attention.default,) if name.startswith("sdpa_") else (aten.softmax.int,),
    )


#: The mask conversions the replacement emits (``logical_not(bool)``, ``mask != 0``).
_MASK_CONVERSIONS = (aten.logical_not.default, aten.ne.Scalar)


def share_mask_conversions(graph: torch.fx.Graph) -> int:
    """Compute each mask conversion once per graph: every layer's ``logical_not(mask)`` of the one shared
    mask (or ``mask != 0``) feeding ``npu_fusion_attention`` is replaced by the first one.

    Each replacement converts its own mask (the pattern replaces one attention at a time), so a model
    whose layers share one ``[B, 1, S, S]`` mask would convert it once per layer (``B·S²`` bytes read
    and written each time: 32 MiB per layer at S=4096) and save one copy per layer for the backward.
    Identical (op, input) pairs compute identical tensors, so sharing them is exact; inputs that are
    identical views of one tensor count as identical (:func:`_view_key`).

    Returns:
        How many conversions were removed.
    """
    first: dict[tuple, torch.fx.Node] = {}
    removed = 0
    fused = torch.ops.npu.npu_fusion_attention.default
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in _MASK_CONVERSIONS:
            continue
        if not node.users or not all(user.target is fused for user in node.users):
            continue
        key = (node.target, _view_key(node.args), _view_key(tuple(sorted(node.kwargs.items()))))
        if key not in first:
            first[key] = node
            continue
        node.replace_all_uses_with(first[key])
        graph.erase_node(node)
        removed += 1
    return removed


def _swaps_last_two(node) -> bool:
    """Whether ``node`` is a 4-D view that swaps the last two dims: ``transpose(2, 3)`` in any spelling
    (``(-2, -1)``, ``(3, 2)``, ``(-1, 2)``...) or ``permute(0, 1, 3, 2)``."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function":
        return False
    source = meta_val(node.args[0]) if node.args else None
    if not isinstance(source, torch.Tensor) or source.dim() != 4:
        return False
    if node.target is aten.transpose.int and len(node.args) == 3:
        return {d % 4 for d in node.args[1:3]} == {2, 3}
    if node.target is aten.permute.default:
        return [d % 4 for d in node.args[1]] == [0, 1, 3, 2]
    return False


def spell_key_transposes(graph: torch.fx.Graph) -> int:
    """Respell every ``matmul(q, kt)`` whose ``kt`` swaps k's last two dims in another spelling
    (``k.transpose(-2, -1)``, ``k.mT``-like permutes) as HF's ``k.transpose(2, 3)``, the one the eager
    variants are traced with. The same view, so exact; returns how many were respelled."""
    count = 0
    for matmul in graph.find_nodes(op="call_function", target=aten.matmul.default):
        kt = matmul.args[1]
        if not _swaps_last_two(kt) or (kt.target is aten.transpose.int and tuple(kt.args[1:3]) == (2, 3)):
            continue
        with graph.inserting_before(matmul):
            spelled = graph.call_function(aten.transpose.int, (kt.args[0], 2, 3))
        spelled.meta.update(kt.meta)
        matmul.replace_input_with(kt, spelled)
        if not kt.users:
            graph.erase_node(kt)
        count += 1
    return count


def _describe_eager_chain(softmax: torch.fx.Node) -> str | None:
    """Name the first piece of the eager chain ending at ``softmax`` that is not spelled as the variants
    expect (``softmax(matmul(q, k.transpose(2, 3)) * scale [+ mask], -1, float32)``), or None."""
    args = softmax.args
    if len(args) < 3 or args[2] != torch.float32:
        return "softmax without dtype=torch.float32 (eager_attention_forward upcasts the scores)"
    node = args[0]
    if isinstance(node, torch.fx.Node) and node.target is aten.add.Tensor:
        node = node.args[0]
    if not (isinstance(node, torch.fx.Node) and node.target in (aten.mul.Tensor, aten.div.Tensor)):
        return f"the scores are {getattr(node, 'target', node)}, not matmul(q, k.transpose(2, 3)) * scale"
    if node.target is aten.div.Tensor:
        return "the scores are divided (matmul / d), not multiplied by the scale (matmul * scale)"
    matmul = node.args[0]
    if not (isinstance(matmul, torch.fx.Node) and matmul.target is aten.matmul.default):
        return f"the scaled scores come from {getattr(matmul, 'target', matmul)}, not matmul(q, k.transpose(2, 3))"
    kt = matmul.args[1]
    if not (isinstance(kt, torch.fx.Node) and kt.target is aten.transpose.int and tuple(kt.args[1:3]) == (2, 3)):
        spelled = f"{kt.target}{tuple(kt.args[1:])}" if isinstance(kt, torch.fx.Node) else repr(kt)
        return (
            f"the key operand of matmul {matmul.name} is {spelled}, not a [B, N, S, D] key's transpose(2, 3) "
            "(the spelling the variants match; other spellings of that swap are respelled)"
        )
    return None


def _view_key(value):
    """A hashable key equal for equal views of one tensor: transformers 4.5x slices the shared mask in
    every layer (``mask[:, :, :, :k_len]``), one identical ``aten.slice`` node per layer."""
    if isinstance(value, (list, tuple)):
        return tuple(_view_key(item) for item in value)
    if (
        isinstance(value, torch.fx.Node)
        and value.op == "call_function"
        and isinstance(value.target, torch._ops.OpOverload)
        and value.target.is_view
    ):
        return (value.target, _view_key(value.args), _view_key(tuple(sorted(value.kwargs.items()))))
    return value


class AttentionPass(FamilyPass):
    """The attention pattern pass (after :func:`spell_key_transposes`), then :func:`share_mask_conversions`."""

    def apply(self, gm: torch.fx.GraphModule, recorder) -> int:
        spell_key_transposes(gm.graph)
        count = super().apply(gm, recorder)
        if count:
            share_mask_conversions(gm.graph)
        return count


class AttentionFamily(FusionFamily):
    """SDPA / eager attention (after repeat_kv) -> ``npu_fusion_attention``; 1 per layer."""

    name = "attention"
    pass_class = AttentionPass
    anchor_ops = (aten.scaled_dot_product_attention.default, aten.softmax.int)
    fused_op_names = ("npu_fusion_attention",)
    backward_op_name = "npu_fusion_attention_grad"
    per_layer = 1

    def iter_variants(self):
        # Among variants of one output op the matcher tries them in registration order: the GQA forms
        # (K/V swallowed un-repeated) come before "mha", which would match a repeat_kv output as plain
        # K/V (its check refuses that anyway). Scale (and dropout) are literals in static graphs and
        # graph inputs under dynamic=True: scalar_workaround, never baked in.
        # SDPA: no casts, so the graph is dtype-independent and fp32 examples cover every dtype.
        for kv in ("repeat_kv", "repeat_kv_symbolic", "gqa", "mha"):
            for mask, mask_why in SDPA_MASKS.items():
                for dropout in (False, True):
                    search, replace = _sdpa_functions(kv, mask, dropout)
                    yield _variant(
                        f"sdpa_{mask}_{kv}{'_dropout' if dropout else ''}",
                        search,
                        replace,
                        _examples(kv, torch.float32, torch.bool if mask == "mask" else None, dropout),
                        _make_check(kv, None),
                        {"scale": _SCALE, **({"dropout_p": _DROPOUT_P} if dropout else {})},
                        f"{mask_why}; {KV_FORMS[kv]}; "
                        + ("dropout_p > 0 (training)" if dropout else "dropout_p 0, omitted from the call"),
                    )
        # Eager: aten.dropout is always in the graph, its train flag baked in (it decides what p means);
        # half precision casts the fp32 softmax back to q's dtype, a no-op removed in fp32 graphs.
        # One variant per half dtype: the prebuilt exact pattern bakes in the cast's dtype literal.
        precisions = {
            "bf16": (torch.bfloat16, "bf16, softmax cast back"),
            "fp16": (torch.float16, "fp16, softmax cast back"),
            "fp32": (torch.float32, "fp32"),
        }
        for kv in ("repeat_kv", "repeat_kv_symbolic", "mha"):
            for label, (dtype, precision_why) in precisions.items():
                for train in (True, False):
                    search, replace = _eager_functions(kv, train)
                    yield _variant(
                        f"eager_{kv}_{label}_{'train' if train else 'infer'}",
                        search,
                        replace,
                        _examples(kv, dtype, dtype, True),
                        _make_check(kv, train),
                        {"scale": _SCALE, "dropout_p": _DROPOUT_P},
                        f"eager_attention_forward, {precision_why}, {'training' if train else 'eval'} dropout; "
                        f"{KV_FORMS[kv]}",
                    )

    def explain_near_miss(self, anchor: torch.fx.Node) -> str:
        if anchor.target is aten.scaled_dot_product_attention.default:
            return (
                f"scaled_dot_product_attention at {node_source(anchor)} has a form no variant covers "
                f"({_describe_sdpa(anchor)}); variants take attn_mask, or attn_mask=None with is_causal, "
                "and K/V plain, repeat_kv'd or enable_gqa"
            )
        generic = super().explain_near_miss(anchor)
        spelling = _describe_eager_chain(anchor) if anchor.target is aten.softmax.int else None
        return generic if spelling is None or "also used outside" in generic else f"{generic}: {spelling}"


def _describe_sdpa(node: torch.fx.Node) -> str:
    names = [argument.name for argument in node.target._schema.arguments]
    bound = dict(zip(names, node.args))
    bound.update(node.kwargs)
    parts = []
    for name in ("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"):
        value = bound.get(name)
        if isinstance(value, torch.fx.Node):
            val = meta_val(value)
            value = f"{val.dtype} {tuple(val.shape)}" if isinstance(val, torch.Tensor) else value.name
        parts.append(f"{name}={value}")
    return ", ".join(parts)
