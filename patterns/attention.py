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

Each way a captured graph spells this is one row of :data:`SPELLINGS` (the variant table: which
transformers version, attention implementation and setting produces it); :func:`_variant` turns a row
into a :class:`~qwen_npu_compile.fusion.PatternVariant`. In short (torch 2.13, transformers 5.24; q is
``rotary(linear.view.transpose)``, BNSD shape over BSND memory; dropout is ``attention_dropout`` in
training, else 0):

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
one on dim 3 (S) sits inside repeat_kv and gets its own rows. With n_rep == 1 (MHA) there is no
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

An explicit mask (shape 1, or the eager chain's additive mask) that is provably the plain causal mask
gets the same ``sparse_mode=2`` and compressed mask instead of ``logical_not(mask)`` (the eager chain then
has no fully masked row to recompute): the mask is a graph constant built from sizes only (no padding
mask, no user-passed position ids, static S) and its compile-time value is ``tril(ones(S, S))``
(:func:`.attention_mask.causal_mask_reason`). That is what transformers 5.x builds for every compiled
training forward without ``attention_mask`` (its packed-sequence mask from the default position ids) and
4.57 for every compiled forward; the ``[B, 1, S, S]`` mask subgraph then becomes dead code. Which form was
chosen, and why an explicit mask was kept, is logged at DEBUG (logger
``qwen_npu_compile.patterns.attention_mask``) and visible in the dump's ``rewritten.py`` (``sparse_mode``).
Padding and packed sequences keep the explicit mask: the kernel's ``actual_seq_qlen``/``actual_seq_kvlen``
(varlen) work only in the TND layout, which torchair's GE converter refuses (BSH and BNSD only), and in
BSH/BNSD key padding has no other form than an S×S mask.

Constraints (``shared/reference/npu-op-contracts.md``; torch_npu 2.13.0 ``npu_fusion_attention`` docs,
Meta kernel and torchair GE converter). Every limit of the op lives in
:func:`~qwen_npu_compile.npu_ops.fusion_attention.fusion_attention_violation`; what the masks need lives
in :mod:`.attention_mask`. This module adds what the *rewrite* needs:

- ``head_num`` = Nq and native GQA (query head h reads kv head h // n_rep, which is what repeat_kv
  builds): n_rep is taken from the shapes and re-checked against the matched expand
  (:func:`_repeat_kv_reason`).
- ``atten_mask`` is bool with **True = masked out** (:func:`.attention_mask.masked_out`); an additive
  float mask must be provably 0 / ``finfo.min`` (:func:`.attention_mask.check_additive_mask`).
  ``is_causal`` (left-up, as in PyTorch), and an explicit mask proven to be ``tril`` with Sq == Skv, is
  ``sparse_mode=2`` with the 2048x2048 compressed mask (what the torch_npu docs require for mode 2).
  ``scale`` defaults to 1.0 in the op: always passed explicitly, as a Python float
  (:func:`~qwen_npu_compile.npu_ops.scalars.scalar_argument`).
- ``inner_precise=2`` with an explicit mask: left padding masks whole query rows, which only mode 2
  computes correctly. Such rows give 0, as PyTorch SDPA (>= 2.5) gives; HF's *eager* chain gives the mean
  of V there instead, so the fused eager chain replaces those rows by exactly that
  (:func:`.attention_mask.eager_fully_masked_rows`).
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

import contextvars
import dataclasses
import math
import sys

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from qwen_npu_compile.compat import guard_or_false
from qwen_npu_compile.fusion import (
    CompileTarget,
    FamilyPass,
    FusionFamily,
    PatternVariant,
    count_applied,
    current_target,
    exact_pattern,
    meta_val,
    node_source,
    with_parameters,
)
from qwen_npu_compile.npu_ops.fusion_attention import GE_LAYOUTS, compressed_causal_mask, fusion_attention_violation
from qwen_npu_compile.npu_ops.limits import bound_arguments
from qwen_npu_compile.npu_ops.scalars import scalar_argument

from .attention_mask import (
    causal_mask_reason,
    check_additive_mask,
    eager_fully_masked_rows,
    masked_out,
    share_mask_conversions,
)

aten = torch.ops.aten
F = torch.nn.functional

#: The end of a full ``aten.slice`` (what ``x[:, :, None, :, :]`` leaves on a symbolic dim).
_SLICE_END = sys.maxsize
#: Magic values standing for the module floats while tracing (replaced by wildcards in the pattern).
_SCALE, _DROPOUT_P = 0.171717, 0.113377
#: The only two layouts torchair's GE converter accepts; BSH when q, k, v are dense BSND in memory.
_LAYOUT_BSH, _LAYOUT_BNSD = "BSH", "BNSD"
assert {_LAYOUT_BSH, _LAYOUT_BNSD} == set(GE_LAYOUTS)
_REPEAT_KV_ENDS = (aten.reshape.default, aten.view.default, aten._unsafe_view.default)


# --------------------------------------------------------------------------------------------------
# The variant table: one row per spelling a realistic graph shows.
# --------------------------------------------------------------------------------------------------


_SDPA, _EAGER = "sdpa", "eager"
_FP32, _BF16, _FP16 = torch.float32, torch.bfloat16, torch.float16


@dataclasses.dataclass(frozen=True)
class Spelling:
    """One row of :data:`SPELLINGS`: one way a captured graph spells attention, and what produces it.

    Attributes:
        impl: ``"sdpa"`` (``F.scaled_dot_product_attention``) or ``"eager"`` (``eager_attention_forward``).
        kv: how k/v reach the attention: ``"repeat_kv"`` (HF ``repeat_kv``, static S; swallowed, K/V passed
            un-repeated), ``"repeat_kv_symbolic"`` (the same under a symbolic S, where ``[:, :, None]``
            leaves a full slice on dim 3), ``"gqa"`` (``enable_gqa=True``, no repeat_kv) or ``"mha"``
            (Nq == Nkv: ``repeat_kv`` returns its input).
        mask: SDPA: ``"mask"`` (``attn_mask`` given, ``is_causal=False``), ``"causal"`` (``attn_mask=None,
            is_causal=True``) or ``"none"`` (``attn_mask=None, is_causal=False``); eager: ``"additive"``.
        dropout: SDPA: ``dropout_p`` is a pattern input (a nonzero literal in training graphs; omitted from
            the call at 0); eager: ``F.dropout``'s ``training`` flag (``aten.dropout`` is always in the
            graph, with ``p`` as a pattern input, and ``training`` decides what ``p`` means).
        dtype: the dtype the pattern is traced in. SDPA graphs have no casts, so fp32 covers every
            dtype; eager casts the fp32 softmax back to q's dtype, a literal baked into the pattern
            (bf16, fp16) or a no-op removed in fp32 graphs.
        why: the model code, transformers version and setting that produces this spelling.
    """

    impl: str
    kv: str
    mask: str
    dropout: bool
    dtype: torch.dtype
    why: str

    @property
    def name(self) -> str:
        if self.impl == _SDPA:
            return f"sdpa_{self.mask}_{self.kv}{'_dropout' if self.dropout else ''}"
        dtype = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[self.dtype]
        return f"eager_{self.kv}_{dtype}_{'train' if self.dropout else 'infer'}"

    @property
    def anchor_ops(self) -> tuple:
        """The op of this spelling that the canonical graph always holds (lazy registration keys on it)."""
        return (aten.scaled_dot_product_attention.default,) if self.impl == _SDPA else (aten.softmax.int,)

    @property
    def parameters(self) -> tuple[str, ...]:
        """The pattern's inputs, in order: exactly those the traced subgraph uses (an unused one breaks it)."""
        mask = ("attn_mask",) if self.mask in ("mask", "additive") else ()
        dropout = ("dropout_p",) if self.impl == _EAGER or self.dropout else ()
        return ("query", "key", "value", *mask, "scale", *dropout)


#: Every spelling, in registration order. Among variants of one output op the matcher tries them in
#: this order: the GQA forms (K/V swallowed un-repeated) come before "mha", which would match a
#: repeat_kv output as plain K/V (its check refuses that anyway). Scale (and dropout) are literals in
#: static graphs and graph inputs under dynamic=True: scalar_workaround, never baked in.
SPELLINGS: tuple[Spelling, ...] = (
    # Columns: impl, kv, mask, dropout, dtype, why (the setting that produces it: see the per-row test,
    # tests/patterns/test_attention_variants.py, which compiles transformers' own attention function in it).
    #
    # --- SDPA (transformers integrations/sdpa_attention.py), GQA with K/V repeated -------------------
    # Whole-model compile builds an explicit bool mask for every forward without a KV cache (5.x: the
    # packed-sequence mask even without padding; 4.57: under compile always), padded or not.
    Spelling(_SDPA, "repeat_kv", "mask", False, _FP32,
             "GQA Qwen2/Qwen3/Llama/Mistral, sdpa, whole-model compile (training, eval, cached generation "
             "on 4.57), or per-layer compile with padding; static shapes"),
    Spelling(_SDPA, "repeat_kv", "mask", True, _FP32,
             "the same in training with config.attention_dropout > 0"),
    # Symbolic S (dynamic=True, or Dynamo's automatic dynamic after a second length): repeat_kv's
    # [:, :, None] leaves a full slice on dim 3 inside the chain.
    Spelling(_SDPA, "repeat_kv_symbolic", "mask", False, _FP32,
             "as sdpa_mask_repeat_kv under a symbolic sequence length"),
    Spelling(_SDPA, "repeat_kv_symbolic", "mask", True, _FP32,
             "the same in training with config.attention_dropout > 0"),
    # --- SDPA, GQA with enable_gqa=True (use_gqa_in_sdpa: no mask, head_dim <= 256) -----------------
    Spelling(_SDPA, "gqa", "mask", False, _FP32,
             "TRANSFORMERS_SDPA_FORCE_GQA=1 (transformers 5.x): enable_gqa=True even with a mask"),
    Spelling(_SDPA, "gqa", "mask", True, _FP32,
             "the same in training with config.attention_dropout > 0"),
    Spelling(_SDPA, "gqa", "causal", False, _FP32,
             "GQA, sdpa, transformers 5.x, no mask and q_len > 1: whole-model KV-cache prefill without "
             "padding, or per-layer compile without padding"),
    Spelling(_SDPA, "gqa", "causal", True, _FP32,
             "per-layer compile without padding in training with config.attention_dropout > 0"),
    Spelling(_SDPA, "gqa", "none", False, _FP32,
             "GQA, sdpa, transformers 5.x, KV-cache decode (q_len 1) without padding"),
    # --- SDPA, MHA (Nq == Nkv: Qwen1.5 checkpoints on modeling_qwen2, GPT-2, ViT) -------------------
    Spelling(_SDPA, "mha", "mask", False, _FP32,
             "MHA, sdpa, whole-model compile without a KV cache, or any padded forward"),
    Spelling(_SDPA, "mha", "mask", True, _FP32,
             "the same in training with config.attention_dropout > 0"),
    Spelling(_SDPA, "mha", "causal", False, _FP32,
             "MHA, sdpa, no mask and q_len > 1: KV-cache prefill without padding, GPT-2 training"),
    Spelling(_SDPA, "mha", "causal", True, _FP32,
             "GPT-2 training (attn_pdrop 0.1 by default); MHA per-layer training with attention dropout"),
    Spelling(_SDPA, "mha", "none", False, _FP32,
             "MHA, sdpa, KV-cache decode (q_len 1) without padding; a non-causal encoder (ViT) in eval"),
    # --- Eager (modeling_qwen2.eager_attention_forward), always with the additive mask --------------
    # The dtype is the compute dtype: bf16 = model.to(bfloat16) or FSDP MixedPrecision(param_dtype=bf16)
    # (verl's default); fp16 = the same in float16 (Ascend 910A has no bf16); fp32 = fp32 weights, also
    # under torch.autocast (the rotary promotes q/k to fp32, so the cast back is a no-op).
    Spelling(_EAGER, "repeat_kv", "additive", True, _BF16, "GQA, eager, bf16 training, static shapes"),
    Spelling(_EAGER, "repeat_kv", "additive", False, _BF16, "GQA, eager, bf16 eval or generation"),
    Spelling(_EAGER, "repeat_kv", "additive", True, _FP16, "GQA, eager, fp16 training"),
    Spelling(_EAGER, "repeat_kv", "additive", False, _FP16, "GQA, eager, fp16 eval or generation"),
    Spelling(_EAGER, "repeat_kv", "additive", True, _FP32, "GQA, eager, fp32 training, or autocast training"),
    Spelling(_EAGER, "repeat_kv", "additive", False, _FP32, "GQA, eager, fp32 eval or generation"),
    Spelling(_EAGER, "repeat_kv_symbolic", "additive", True, _BF16, "GQA, eager, bf16 training, symbolic S"),
    Spelling(_EAGER, "repeat_kv_symbolic", "additive", False, _BF16, "GQA, eager, bf16 eval, symbolic S"),
    Spelling(_EAGER, "repeat_kv_symbolic", "additive", True, _FP16, "GQA, eager, fp16 training, symbolic S"),
    Spelling(_EAGER, "repeat_kv_symbolic", "additive", False, _FP16, "GQA, eager, fp16 eval, symbolic S"),
    Spelling(_EAGER, "repeat_kv_symbolic", "additive", True, _FP32, "GQA, eager, fp32 training, symbolic S"),
    Spelling(_EAGER, "repeat_kv_symbolic", "additive", False, _FP32,
             "GQA, eager, fp32 eval, symbolic S (also the cache length from the second decode step)"),
    Spelling(_EAGER, "mha", "additive", True, _BF16, "MHA (Qwen1.5 on modeling_qwen2), eager, bf16 training"),
    Spelling(_EAGER, "mha", "additive", False, _BF16, "MHA, eager, bf16 eval"),
    Spelling(_EAGER, "mha", "additive", True, _FP16, "MHA, eager, fp16 training"),
    Spelling(_EAGER, "mha", "additive", False, _FP16, "MHA, eager, fp16 eval"),
    Spelling(_EAGER, "mha", "additive", True, _FP32, "MHA, eager, fp32 or autocast training (any S: no repeat_kv)"),
    Spelling(_EAGER, "mha", "additive", False, _FP32, "MHA, eager, fp32 eval"),
)  # fmt: skip
# Not in the table:
# - repeat_kv with attn_mask=None (is_causal or decode). transformers 5.x passes enable_gqa instead whenever
#   there is no mask (head_dim <= 256: every supported family); 4.57 repeats K/V on an Ascend host
#   (use_gqa_in_sdpa is False on NPU), but it always builds a mask for a compiled forward (whole-model,
#   and per-layer training: measured), and per-layer compile runs cache-using layers eagerly. Such a graph
#   (head_dim > 256 on 5.x) is a near miss with its reason, not a wrong fusion.
# - SDPA with no mask, is_causal=False and dropout: such a call carries attn_mask=None positionally
#   (dropout_p follows it), so the "mask" rows with dropout, registered first, bind attn_mask=None and
#   fuse it (a non-causal encoder such as ViT training with attention dropout, F.sdpa(q, k, v, dropout_p=p)).


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


def _sdpa(query, key, value, attn_mask=None, scale=None, dropout_p=0.0, *, row: Spelling):
    """``sdpa_attention_forward``'s call, after its repeat_kv / enable_gqa choice."""
    key, value = _searched_kv(query, key, value, row.kv)
    extra = {"enable_gqa": True} if row.kv == "gqa" else {}  # as sdpa_attention_forward passes it
    return F.scaled_dot_product_attention(
        query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, scale=scale, is_causal=row.mask == "causal",
        **extra,
    )


def _eager(query, key, value, attn_mask, scale, dropout_p, *, row: Spelling):
    """``eager_attention_forward`` (the attention weights not returned)."""
    key, value = _searched_kv(query, key, value, row.kv)
    attn_weights = torch.matmul(query, key.transpose(2, 3)) * scale
    attn_weights = attn_weights + attn_mask
    attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
    attn_weights = F.dropout(attn_weights, p=dropout_p, training=row.dropout)
    return torch.matmul(attn_weights, value)


def _search_fn(row: Spelling):
    def search(**inputs):
        return (_sdpa if row.impl == _SDPA else _eager)(**inputs, row=row)

    return with_parameters(search, row.parameters)


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
            if _CAUSAL_MASK.get():  # the explicit mask is provably causal: not read
                return fused_attention(query, key, value, causal=True, scale=scale, dropout_p=dropout_p)
            causal = row.mask == "causal"
            return fused_attention(query, key, value, attn_mask, causal=causal, scale=scale, dropout_p=dropout_p)
        dropout_p = dropout_p if row.dropout else 0.0
        if _CAUSAL_MASK.get():  # provably causal with Sq == Skv: no row is fully masked
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

    The op's limits are :func:`~qwen_npu_compile.npu_ops.fusion_attention.fusion_attention_violation`'s
    (torch_npu 2.13.0 ``npu_fusion_attention`` docs, Meta kernel and torchair GE converter); this adds
    4-D non-empty tensors, a bool or floating mask, and what dropout needs (:func:`_dropout_reason`).

    Args:
        query: ``[B, Nq, Sq, D]``.
        key: ``[B, Nkv, Skv, D]``, un-repeated.
        value: ``[B, Nkv, Skv, Dv]``.
        attn_mask: None, or the SDPA/eager mask (bool, or a float mask already verified by
            :func:`.attention_mask.check_additive_mask`).
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


def _scale_for(bound):
    """The scale the replacement passes: the constant the check read, else the matched value."""
    constant = _SCALE_CONSTANT.get()
    return bound if constant is None else constant


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


#: Set by a variant's check: True when the matched explicit mask is provably the plain causal mask
#: (:func:`.attention_mask.causal_mask_reason`); the replacement then uses ``sparse_mode=2`` with the
#: compressed mask and leaves the ``[B, 1, S, S]`` mask unread (it becomes dead code).
_CAUSAL_MASK: contextvars.ContextVar[bool] = contextvars.ContextVar("qwen_npu_attention_causal", default=False)


def _plain_causal(query, key, mask_node: torch.fx.Node) -> bool:
    """Whether the explicit mask of an attention over ``query [B, Nq, Sq, D]`` and ``key [B, Nkv, Skv, D]``
    is provably the plain causal mask with Sq == Skv (static sizes), so ``sparse_mode=2`` is exact."""
    if causal_mask_reason(mask_node) is not None:  # the reason is logged there (debug)
        return False
    q_len, kv_len = query.shape[2], key.shape[2]
    return isinstance(q_len, int) and q_len == kv_len == meta_val(mask_node).shape[-1]


def _autocast_cast(*tensors):
    """q, k, v in the dtype autocast gives them (:data:`_AUTOCAST_DTYPE`), else unchanged."""
    dtype = _AUTOCAST_DTYPE.get()
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
            _AUTOCAST_DTYPE.set(cast_dtype)
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
        _CAUSAL_MASK.set(reason is None and isinstance(mask_node, torch.fx.Node) and _plain_causal(q, k, mask_node))
        return reason

    return check


# --------------------------------------------------------------------------------------------------
# The generator: table rows -> PatternVariants.
# --------------------------------------------------------------------------------------------------


def _examples(row: Spelling):
    """q [2, 4, 8, 16]; k/v with 2 KV heads (4 for MHA); a [2, 1, 8, 8] mask; the magic scalars."""
    kv_heads = 4 if row.kv == "mha" else 2
    mask_dtype = torch.bool if row.impl == _SDPA else row.dtype

    def build():
        inputs = {
            "query": torch.empty(2, 4, 8, 16, dtype=row.dtype),
            "key": torch.empty(2, kv_heads, 8, 16, dtype=row.dtype),
            "value": torch.empty(2, kv_heads, 8, 16, dtype=row.dtype),
            "attn_mask": torch.zeros(2, 1, 8, 8, dtype=mask_dtype),
            "scale": _SCALE,
            "dropout_p": _DROPOUT_P,
        }
        return [inputs[name] for name in row.parameters]

    return build


def _variant(row: Spelling) -> PatternVariant:
    """The :class:`~qwen_npu_compile.fusion.PatternVariant` of one table row (its exact pattern traced here)."""
    search_fn, examples = _search_fn(row), _examples(row)
    magic = {"scale": _SCALE, "dropout_p": _DROPOUT_P}
    scalar_workaround = {name: value for name, value in magic.items() if name in row.parameters}
    return PatternVariant(
        name=row.name,
        search_fn=search_fn,
        replace_fn=_replace_fn(row),
        example_inputs=examples,
        check=_check_fn(row),
        scalar_workaround=scalar_workaround,
        why=row.why,
        # exact but for size lists: repeat_kv's under symbolic B and S (see fusion.exact_pattern)
        # built at registration: a variant no graph needs is never traced (FamilyPass registers lazily)
        search_fn_pattern=lambda: exact_pattern(search_fn, examples(), scalar_workaround),
        anchor_ops=row.anchor_ops,
    )


# --------------------------------------------------------------------------------------------------
# The family.
# --------------------------------------------------------------------------------------------------


#: Variant name of a ``qwen_npu.varlen_attention`` that the captured graph already holds because the
#: packed-sequence integration put it in place of transformers' flash-attention / SDPA call at trace time
#: (:mod:`qwen_npu_compile.integrations.varlen`, per-layer compile): its limits were checked there.
TAKEOVER_VARIANT = "varlen_packed_offsets"


def count_varlen_takeovers(graph: torch.fx.Graph) -> int:
    """Count (as fusions of :data:`TAKEOVER_VARIANT`) the ``qwen_npu.varlen_attention`` calls ``graph``
    holds before the attention pass runs; returns their number."""
    from qwen_npu_compile.npu_ops import varlen_attention

    count = len(graph.find_nodes(op="call_function", target=varlen_attention.OP))
    count_applied(TAKEOVER_VARIANT, count)
    return count


class AttentionPass(FamilyPass):
    """The attention pattern pass (after :func:`spell_key_transposes`), then
    :func:`.attention_mask.share_mask_conversions` and :func:`.attention_varlen.share_seq_ends`."""

    def apply(self, gm: torch.fx.GraphModule, recorder) -> int:
        taken_over = count_varlen_takeovers(gm.graph)
        spell_key_transposes(gm.graph)
        count = super().apply(gm, recorder)
        if count:
            share_mask_conversions(gm.graph)
            from . import attention_varlen  # imports this module

            attention_varlen.share_seq_ends(gm.graph)
        return count + taken_over

    def anchor_nodes(self, graph: torch.fx.Graph) -> list[torch.fx.Node]:
        """The family's anchors, less the softmaxes that are not attention (:func:`is_linear_logits_softmax`):
        those are neither near misses nor counted as anchors."""
        return [node for node in super().anchor_nodes(graph) if not is_linear_logits_softmax(node)]


class AttentionFamily(FusionFamily):
    """SDPA / eager attention (after repeat_kv) -> ``npu_fusion_attention``; 1 per layer."""

    name = "attention"
    pass_class = AttentionPass
    anchor_ops = (aten.scaled_dot_product_attention.default, aten.softmax.int)
    fused_op_names = ("npu_fusion_attention",)
    backward_op_name = "npu_fusion_attention_grad"
    per_layer = 1

    @classmethod
    def expected_per_layer(cls, model_config, layer_type: str | None = None) -> int:
        """1 per decoder layer; 0 in a hybrid model's linear-attention (Gated DeltaNet) layers (Qwen3.5,
        Qwen3.5-MoE, Qwen3-Next ``layer_types``): their chunked delta rule is no softmax attention."""
        return 0 if layer_type == "linear_attention" else cls.per_layer

    def iter_variants(self):
        from . import attention_varlen  # imports this module

        # the packed-sequence variants first: each takes what its row would, when the mask is proven packed
        yield from attention_varlen.varlen_variants()
        yield from (_variant(row) for row in SPELLINGS)

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


# --------------------------------------------------------------------------------------------------
# Before matching: one spelling of the key transpose. After: naming what did not match.
# --------------------------------------------------------------------------------------------------


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


#: Ops that pass scores through unchanged in kind (casts and views): walked over to find what made them.
_PASS_THROUGH = (aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default, aten.view.default,
                 aten.reshape.default, aten.contiguous.default, aten.clone.default)


def is_linear_logits_softmax(node: torch.fx.Node) -> bool:
    """Whether ``node`` is a softmax of the logits of a linear layer (an activation times a weight:
    ``aten.linear``, after casts and views), such as the MoE router's ``softmax(linear(x, gate.weight))``
    (transformers ``Qwen3MoeTopKRouter`` / ``Qwen2MoeTopKRouter``, 4.57's ``self.gate`` nn.Linear). Attention
    scores are a product of two activations (``matmul(q, k.transpose(2, 3))``, or SDPA), never a
    linear layer, so such a softmax is not attention and not an attention near miss."""
    if node.target is not aten.softmax.int or not node.args:
        return False
    scores = node.args[0]
    for _ in range(len(_PASS_THROUGH) + 1):
        if not isinstance(scores, torch.fx.Node) or scores.target not in _PASS_THROUGH:
            break
        scores = scores.args[0]
    return isinstance(scores, torch.fx.Node) and scores.target is aten.linear.default


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


def _describe_sdpa(node: torch.fx.Node) -> str:
    bound = bound_arguments(node)
    parts = []
    for name in ("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"):
        value = bound.get(name)
        if isinstance(value, torch.fx.Node):
            val = meta_val(value)
            value = f"{val.dtype} {tuple(val.shape)}" if isinstance(val, torch.Tensor) else value.name
        parts.append(f"{name}={value}")
    return ", ".join(parts)
