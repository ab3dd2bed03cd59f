"""The attention variant table: every way a captured graph spells attention, and the search side
(the subgraphs as transformers computes them). The bottom of the attention family (``patterns/attention/``):
it imports nothing of the family.


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
transformers version, attention implementation and setting produces it); :func:`row_variant` (with
:mod:`.dense`'s replacement and check) turns a row into a :class:`~qwen_npu_compile.fusion.family.PatternVariant`.
In short (torch 2.13, transformers 5.24; q is
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

"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable

import torch

from qwen_npu_compile.fusion.family import PatternVariant, exact_pattern, with_parameters
from qwen_npu_compile.ops.attention_contract import GE_LAYOUTS

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
    # The rows share one shape by design: this table is data (one row per spelling), not repeated logic.
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


def row_variant(row: Spelling, *, name: str, parameters: tuple[str, ...], search_fn: Callable, replace_fn: Callable,
                check: Callable, why: str, decides: tuple = ()) -> PatternVariant:
    """The :class:`~qwen_npu_compile.fusion.family.PatternVariant` of one table row with the given replacement and
    check (its exact pattern traced at registration; the example inputs of :func:`_examples`).

    Args:
        row: the table row (its anchor ops and example inputs).
        name: the variant's name.
        parameters: the pattern's input names, in the row's order (a variant may rename them).
        search_fn: the subgraph, taking ``parameters``.
        replace_fn: its replacement.
        check: the match check (a refusal reason or None).
        why: the setting that produces the spelling.
        decides: the check's decisions the replacement reads (:attr:`PatternVariant.decides`).

    Returns:
        The variant: scale (and dropout) as ``scalar_workaround``, never baked into the pattern.
    """
    examples = _examples(row)
    magic = {"scale": _SCALE, "dropout_p": _DROPOUT_P}
    scalar_workaround = {key: value for key, value in magic.items() if key in parameters}
    return PatternVariant(
        name=name,
        search_fn=search_fn,
        replace_fn=replace_fn,
        example_inputs=examples,
        check=check,
        scalar_workaround=scalar_workaround,
        why=why,
        # exact but for size lists: repeat_kv's under symbolic B and S (see fusion.exact_pattern)
        # built at registration: a variant no graph needs is never traced (FamilyPass registers lazily)
        search_fn_pattern=lambda: exact_pattern(search_fn, examples(), scalar_workaround),
        anchor_ops=row.anchor_ops,
        decides=decides,
    )
