"""The attention variant table (``patterns/attention/spellings.py``: ``SPELLINGS``): every row matches the graph that
transformers' own attention functions give in the setting its ``why`` names, and fuses it with parity.

Each row is exercised alone (a pass holding only that row's variant), on transformers' real
``sdpa_attention_forward`` / ``eager_attention_forward`` with a stand-in module, compiled with Dynamo and
retraced like every model graph (``canonicalize.to_aten_graph``). What the row's fields stand for:

* ``kv``: ``gqa`` = ``use_gqa_in_sdpa`` answers True (transformers 5.x, or 4.57 off NPU, without a mask;
  with a mask: ``TRANSFORMERS_SDPA_FORCE_GQA=1``); ``repeat_kv`` = it answers False (a mask, or
  transformers 4.57 on an Ascend host); ``repeat_kv_symbolic`` = the same with a symbolic sequence length
  (``dynamic=True`` or Dynamo's automatic dynamic); ``mha`` = ``num_key_value_groups == 1``.
* ``mask``: ``mask``/``additive`` = a padding-style mask; ``causal`` = no mask, ``q_len > 1`` (per-layer
  compile or cache prefill without padding); ``none`` = no mask with ``q_len == 1`` (decode).
* ``dropout``: SDPA ``dropout=0.1`` (``config.attention_dropout``); eager ``module.training``.

Whole-model graphs of the tiny Qwen2 (which rows they hit) are covered in ``test_attention.py``,
``test_stack_compat.py`` and ``test_model_families.py``.
"""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

from qwen_npu_compile.fusion.family import CompileTarget, RefusalRecorder, targeting
from qwen_npu_compile.graph import canonicalize
from qwen_npu_compile.graph.utils import trace_pattern
from qwen_npu_compile.ops.limits import bound_arguments
from qwen_npu_compile.patterns import attention

ROWS = {row.name: row for row in attention.SPELLINGS}
#: Dropout on real (non-simulated) ops with a non-GE downstream: the only target that fuses it.
REAL_OFF_GE = CompileTarget("aot_eager", simulated=False)
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


#: The names of the variants whose check accepted a match, in order (filled by the checks of :func:`recording_pass`).
ACCEPTED: list[str] = []


@pytest.fixture(scope="module")
def recording_pass(npu_ops):
    """The whole attention family, in its registration order, with every check recording its acceptances:
    a setting must be fused by *its* row, not by an earlier one that shadows it."""

    def recorded(variant):
        def check(match):
            reason = variant.check(match)
            if reason is None:
                ACCEPTED.append(variant.name)
            return reason

        return dataclasses.replace(variant, check=check)

    class Recording(attention.AttentionFamily):
        def iter_variants(self):
            return (recorded(variant) for variant in super().iter_variants())

    return attention.AttentionPass(Recording())


def _setting(row, monkeypatch):
    """``(fn, args, symbolic)``: transformers' attention function of ``row.impl`` in the row's setting."""
    from transformers.integrations import sdpa_attention
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.models.qwen2.modeling_qwen2 import eager_attention_forward

    n_rep = 1 if row.kv == "mha" else 2
    q_len = 1 if row.mask == "none" else 8
    module = types.SimpleNamespace(num_key_value_groups=n_rep, training=row.dropout, is_causal=True)
    monkeypatch.setattr(sdpa_attention, "use_gqa_in_sdpa", lambda *args, **kwargs: row.kv == "gqa")
    with_mask = row.mask in ("mask", "additive")
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, q_len, 16, generator=generator).to(row.dtype)
    k, v = (torch.randn(2, 4 // n_rep, 8, 16, generator=generator).to(row.dtype) for _ in range(2))
    keep = torch.ones(2, 1, q_len, 8, dtype=torch.bool).tril(diagonal=8 - q_len)  # causal, no fully masked row

    def sdpa(q, k, v, keep):
        mask = keep if with_mask else None
        dropout = 0.1 if row.dropout else 0.0
        return sdpa_attention_forward(module, q, k, v, mask, dropout=dropout, scaling=0.25)[0]

    def eager(q, k, v, keep):
        mask = torch.where(keep, torch.zeros((), dtype=q.dtype), torch.finfo(q.dtype).min)  # masking_utils.eager_mask
        return eager_attention_forward(module, q, k, v, mask, scaling=0.25, dropout=0.0)[0]

    return (sdpa if row.impl == "sdpa" else eager), (q, k, v, keep), row.kv == "repeat_kv_symbolic"


@pytest.mark.parametrize("name", sorted(ROWS))
def test_row_matches_its_setting(recording_pass, monkeypatch, name):
    row = ROWS[name]
    assert row.why and row.anchor_ops
    fn, args, symbolic = _setting(row, monkeypatch)
    ACCEPTED.clear()
    seen = []

    def backend(gm, example_inputs):
        aten_gm = canonicalize.to_aten_graph(gm, example_inputs)
        recorder = RefusalRecorder()
        with targeting(REAL_OFF_GE):
            seen.append((recording_pass.apply(aten_gm, recorder), [r.reason for r in recorder.live(aten_gm.graph)]))
        aten_gm.graph.eliminate_dead_code()
        aten_gm.recompile()
        return aten_gm.forward

    if symbolic:  # the key length; the query length too unless it is 1 (decode)
        q, k, v, keep = args
        for t, dim in ((k, 2), (v, 2), (keep, 3)) + (((q, 2), (keep, 2)) if q.shape[2] > 1 else ()):
            torch._dynamo.mark_dynamic(t, dim)
    out = torch.compile(fn, backend=backend, fullgraph=True)(*args)
    assert seen == [(1, [])]
    assert ACCEPTED == [name]  # fused by this row, not by an earlier one
    if not row.dropout or row.impl == "eager":  # eager's training rows run with dropout 0.0, as Qwen2's default
        expected = fn(*args)
        error = (out.float() - expected.float()).abs().max() / expected.float().abs().max()
        assert error.item() <= TOLERANCE[row.dtype], error


def test_every_row_anchors_on_an_op_of_its_own_pattern(npu_ops):
    """Lazy registration traces a row only when its ``anchor_ops`` occur in the graph: each anchor op must
    be a node of the row's traced pattern (else the row could never be registered where it matches)."""
    for row in attention.SPELLINGS:
        variant = attention.dense._variant(row)
        traced = trace_pattern(variant.search_fn, list(variant.example_inputs()))
        ops = {node.target for node in traced.graph.nodes if node.op == "call_function"}
        assert set(variant.anchor_ops) <= ops, (row.name, variant.anchor_ops)
        assert set(variant.anchor_ops) <= set(attention.AttentionFamily.anchor_ops)


def test_dropout_without_a_mask_is_fused_by_the_mask_rows(recording_pass, monkeypatch):
    """A non-causal module without a mask training with attention dropout (ViT-style): the SDPA node
    carries ``attn_mask=None`` positionally, so the "mask" row with dropout binds it (no "none" row with
    dropout exists) and fuses it without a mask."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    module = types.SimpleNamespace(num_key_value_groups=1, training=True, is_causal=False)
    ACCEPTED.clear()
    counts = []

    def backend(gm, example_inputs):
        aten_gm = canonicalize.to_aten_graph(gm, example_inputs)
        with targeting(REAL_OFF_GE):
            counts.append(recording_pass.apply(aten_gm, RefusalRecorder()))
        (call,) = aten_gm.graph.find_nodes(op="call_function", target=torch.ops.npu.npu_fusion_attention.default)
        bound = bound_arguments(call)
        assert bound.get("atten_mask") is None and bound["keep_prob"] == pytest.approx(0.9)
        return gm.forward

    def attention_fn(q, k, v):
        return sdpa_attention_forward(module, q, k, v, None, dropout=0.1, scaling=0.25)[0]

    torch.compile(attention_fn, backend=backend, fullgraph=True)(*(torch.randn(2, 4, 8, 16) for _ in range(3)))
    # transformers 4.57 passes enable_gqa=True without a mask even when Nq == Nkv (5.x only for GQA), which
    # the gqa row takes: the same replacement for un-repeated K/V
    assert counts == [1] and ACCEPTED in (["sdpa_mask_mha_dropout"], ["sdpa_mask_gqa_dropout"])
