"""Qwen3.5 / Qwen3.5-MoE / Qwen3-Next full-attention layers (transformers 5.24.0 ``modeling_qwen3_5.py``,
``modeling_qwen3_5_moe.py``, ``modeling_qwen3_next.py``): the partial rotary (``partial_rotary_factor`` 0.25:
rotary on ``q/k[..., :head_dim/4]``, the rest passed through) fuses as ``npu_rotary_mul`` on the rotated part
(variant ``rotary_partial_bsnd``, fused backward), and the gated attention (``q_proj`` -> query and gate,
q/k (1+w) norms, ``attn * sigmoid(gate)``: the gate stays ATen) fuses as Qwen2's does: sdpa and eager, GQA,
padding masks, packed rows (the Qwen3.5 text model stacks ``position_ids[None].expand(4, B, T)``, proven by
``attention_varlen``). Exact counts from ``expected_fusions`` (2 rotary + 1 attention per full-attention
layer, 0 per linear-attention layer), parity against eager (fp32 bounds; bf16 against an fp32 reference).

Tiny random configs, head_dim 64 (rotated width 16) for the whole models; the width checks use head_dim
256 (Qwen3.5's real 64-wide rotated part) on transformers' own ``apply_rotary_pos_emb``.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers.models.qwen3_5", reason="Qwen3.5 needs transformers >= 5")
from transformers.models.qwen3_5 import modeling_qwen3_5

from qwen_npu_compile import get_reports
from qwen_npu_compile.ops.qwen_npu import rotary_mul_aten_backward, rotary_mul_orthogonal
from qwen_npu_compile.patterns import expected_fusions
from tests.helpers.graphs import count_calls
from tests.helpers.models import tiny_hybrid, tiny_hybrid_config
from tests.helpers.numerics import assert_parity

#: the cases' model -> the tiny hybrid family built for it (Qwen3-Next with MoE blocks in every layer)
MODELS = {"qwen3_5": "qwen3_5", "qwen3_5_moe": "qwen3_5_moe", "qwen3_next": "qwen3_next_moe"}
HYBRID = ["linear_attention", "full_attention"]
FULL = ["full_attention"]
FAMILIES = ("rotary", "attention")
NPU = torch.ops.npu


# -- expected counts -------------------------------------------------------------------------------------


@pytest.mark.parametrize("model", sorted(MODELS))
def test_expected_counts_follow_layer_types(model):
    """Published layout (every 4th layer full attention): 2 rotary and 1 attention per full-attention layer."""
    config = tiny_hybrid_config(MODELS[model], num_hidden_layers=8)  # default layer_types: 3 linear + 1 full, twice
    assert config.layer_types.count("full_attention") == 2
    assert expected_fusions(config, FAMILIES) == {"rotary": 4, "attention": 2}
    assert expected_fusions(tiny_hybrid_config(MODELS[model], HYBRID * 2), FAMILIES) == {"rotary": 4, "attention": 2}
    assert expected_fusions(tiny_hybrid_config(MODELS[model], FULL * 3), FAMILIES) == {"rotary": 6, "attention": 3}
    for kind, count in (("linear_attention", 0), ("full_attention", 1)):
        per_layer = expected_fusions(config, FAMILIES, per_layer=True, layer_type=kind)
        assert per_layer == {"rotary": 2 * count, "attention": count}


# -- whole models: exact counts and parity ------------------------------------------------------------------


def _inputs(kind: str) -> dict:
    if kind == "packed":  # verl's use_remove_padding: one row, position ids restarting per sequence
        positions = torch.cat([torch.arange(n) for n in (10, 7, 13, 3)])[None]
        ids = torch.randint(0, 256, positions.shape, generator=torch.Generator().manual_seed(1))
        return {"input_ids": ids, "position_ids": positions}
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    if kind == "padded":  # left padding, the position ids generate() derives from it
        mask = torch.ones(2, 16, dtype=torch.long)
        mask[0, :5] = 0
        return {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)}
    return {"input_ids": ids}


# model, layer types, dtype, attention, inputs, training, families, the attention variant that must fuse.
# Each axis both ways across the cases; one compile each (CI time).
CASES = [
    pytest.param("qwen3_5", HYBRID, torch.bfloat16, "sdpa", "plain", True, "all", "sdpa_mask_repeat_kv",
                 id="qwen3_5-hybrid-bf16-sdpa-train"),
    pytest.param("qwen3_5_moe", FULL, torch.float32, "eager", "padded+checkpointing", True, "rotary,attention",
                 "eager_repeat_kv_fp32_train", id="qwen3_5_moe-fp32-eager-padded-checkpointed-train"),
    pytest.param("qwen3_5", FULL, torch.bfloat16, "eager", "packed", True, "rotary,attention",
                 "varlen_eager_repeat_kv_bf16_train", id="qwen3_5-bf16-eager-packed-train"),
    pytest.param("qwen3_next", FULL, torch.float32, "sdpa", "packed", True, "rotary,attention",
                 "varlen_sdpa_mask_repeat_kv", id="qwen3_next-fp32-sdpa-packed-train"),
    pytest.param("qwen3_next", FULL, torch.bfloat16, "sdpa", "padded", False, "rotary,attention",
                 "sdpa_mask_repeat_kv", id="qwen3_next-bf16-sdpa-padded-infer"),
]


@pytest.mark.parametrize("model_name,layer_types,dtype,attn,inputs,train,fusions,attention_variant", CASES)
def test_counts_and_parity(npu_ops, model_name, layer_types, dtype, attn, inputs, train, fusions, attention_variant):
    model = tiny_hybrid(MODELS[model_name], dtype, attn, layer_types=layer_types).train(train)
    inputs, checkpointing = inputs.split("+")[0], "+checkpointing" in inputs
    if checkpointing:  # cos/sin reach the rotary as inputs of the checkpointed region's body
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    kwargs = _inputs(inputs)
    ids = kwargs.pop("input_ids")
    [report] = assert_parity(model, ids, train, dtype, options={"fusions": fusions, "downstream": "aot_eager"},
                             **kwargs)
    full = layer_types.count("full_attention")
    expected = expected_fusions(model.config, FAMILIES)
    assert expected == {"rotary": 2 * full, "attention": full}
    assert {family: report.fusions[family] for family in FAMILIES} == expected
    assert report.variants["rotary_partial_bsnd"] == 2 * full
    assert report.variants[attention_variant] == full
    assert [r for r in report.refused if r.family in FAMILIES] == []
    forward = report.aot_ops["forward"]
    assert forward["npu_rotary_mul"] == 2 * full
    varlen = attention_variant.startswith("varlen_")
    assert forward.get("npu_fusion_attention", 0) == (0 if varlen else full)
    if train:
        backward = report.aot_ops["backward"]
        assert backward["npu_rotary_mul_backward"] == 2 * full
        assert backward.get("npu_fusion_attention_grad", 0) == (0 if varlen else full)
        recomputed = 1 if checkpointing else 0  # the checkpointed forward runs again in the backward
        assert backward.get("npu_rotary_mul", 0) == 2 * full * recomputed
        assert backward.get("npu_fusion_attention", 0) == (0 if varlen else full) * recomputed
    else:
        assert "backward" not in report.aot_ops


# -- transformers' apply_rotary_pos_emb alone: widths, torchair forms, refusals ------------------------


def _rope(q_bsnd, k_bsnd, cos, sin):
    """The full-attention layer's q/k path: BNSD views of BSND memory, then Qwen3.5's partial rotary."""
    return modeling_qwen3_5.apply_rotary_pos_emb(q_bsnd.transpose(1, 2), k_bsnd.transpose(1, 2), cos, sin)


def _rope_inputs(head_dim: int, rotated: int, dtype=torch.float32, r_grad: bool = False):
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, 4, head_dim, generator=generator, dtype=dtype, requires_grad=True)
    k = torch.randn(2, 8, 2, head_dim, generator=generator, dtype=dtype, requires_grad=True)
    angles = torch.randn(2, 8, rotated // 2, generator=generator).repeat(1, 1, 2)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    return q, k, cos.requires_grad_(r_grad), sin.requires_grad_(r_grad)


def _run(fn, inputs, train: bool):
    """Outputs and (when ``train``) the gradients of every input that requires grad."""
    inputs = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
    outs = fn(*inputs)
    if not train:
        return outs, []
    sum((o.float() * torch.linspace(-1, 1, o.numel()).view(o.shape)).sum() for o in outs).backward()
    return outs, [t.grad for t in inputs if t.requires_grad]


@pytest.mark.parametrize("head_dim,dtype,emitted", [
    (256, torch.bfloat16, "npu_rotary_mul"),  # Qwen3.5's real width 64: the converter takes D % 64 == 0
    (64, torch.float32, "aten_backward"),     # width 16: npu_rotary_mul_backward's converter refuses it
], ids=["d256-rot64-bf16", "d64-rot16-fp32"])
def test_torchair_training_form_follows_the_rotated_width(npu_ops, torchair_target_on_aot_eager, head_dim, dtype,
                                                          emitted):
    """For torchair training the backward converter's limits (D % 64 == 0, static shapes) apply to the rotated
    width (head_dim / 4), not head_dim; cos/sin as inputs (sin's equal halves unproven) without grad."""
    inputs = _rope_inputs(head_dim, head_dim // 4, dtype)
    eager = _run(_rope, inputs, True)
    compiled = _run(torch.compile(_rope, backend="qwen_npu", options={"downstream": "torchair"}), inputs, True)
    tolerance = dict(rtol=1.6e-2, atol=1.6e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    for got, want in zip([*compiled[0], *compiled[1]], [*eager[0], *eager[1]]):
        torch.testing.assert_close(got, want, **tolerance)
    [report] = get_reports()
    assert report.fusions["rotary"] == 2
    assert report.variants == {"rotary_partial_bsnd": 2}
    graphs = torchair_target_on_aot_eager
    op = NPU.npu_rotary_mul.default if emitted == "npu_rotary_mul" else rotary_mul_aten_backward.OP
    assert count_calls(graphs["forward"], op) == 2
    assert count_calls(graphs["backward"], NPU.npu_rotary_mul_backward.default) == (2 if emitted == "npu_rotary_mul" else 0)


def test_torchair_training_with_sin_from_the_rotary_embedding_is_orthogonal(npu_ops, torchair_target_on_aot_eager):
    """cos/sin computed in the graph by Qwen3.5's own rotary embedding (mrope recomposition, ``cat((f, f), -1)``):
    sin's halves are proven equal, so the 16-wide rotated part takes the orthogonal form (no converter limits)."""
    config = tiny_hybrid_config("qwen3_5", FULL)
    rotary_emb = modeling_qwen3_5.Qwen3_5TextRotaryEmbedding(config)

    def fn(q_bsnd, k_bsnd, position_ids):
        cos, sin = rotary_emb(q_bsnd, position_ids.expand(3, -1, -1))
        return _rope(q_bsnd, k_bsnd, cos, sin)

    q, k, _, _ = _rope_inputs(64, 16)
    positions = torch.arange(8).expand(2, -1)[None]
    eager = _run(fn, [q, k, positions], True)
    compiled = _run(torch.compile(fn, backend="qwen_npu", options={"downstream": "torchair"}), [q, k, positions], True)
    for got, want in zip([*compiled[0], *compiled[1]], [*eager[0], *eager[1]]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    [report] = get_reports()
    assert report.variants == {"rotary_partial_bsnd": 2}
    graphs = torchair_target_on_aot_eager
    assert count_calls(graphs["forward"], rotary_mul_orthogonal.OP) == 2
    assert count_calls(graphs["backward"], rotary_mul_orthogonal.OP) == 2
    assert count_calls(graphs["backward"], NPU.npu_rotary_mul_backward.default) == 0


def _rotary_refusals(report) -> list[str]:
    return [r.reason for r in report.refused if r.family == "rotary"]


@pytest.mark.parametrize("head_dim,rotated,options,reason", [
    # the kernel: D < 896 (torch_npu 2.13.0 npu_rotary_mul docs), for the rotated width
    (1024, 900, {}, "rotated part [..., :900] of head dim 1024: head dim D=900 must be even and < 896"),
    # torchair training with cos/sin needing grad: neither the orthogonal nor the ATen backward applies, and
    # npu_rotary_mul_backward's converter needs the rotated width % 64 == 0
    (64, 16, {"downstream": "torchair"}, "needs head dim D % 64 == 0, got D=16"),
], ids=["kernel-width-900", "torchair-width-16-cos-grad"])
def test_refused_rotated_width_keeps_hf_math(npu_ops, torchair_target_on_aot_eager, head_dim, rotated, options, reason):
    inputs = _rope_inputs(head_dim, rotated, r_grad=bool(options))
    train = bool(options)
    eager = _run(_rope, inputs, train)
    compiled = _run(torch.compile(_rope, backend="qwen_npu", options=options), inputs, train)
    for got, want in zip([*compiled[0], *compiled[1]], [*eager[0], *eager[1]]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    [report] = get_reports()
    assert report.fusions["rotary"] == 0
    refusals = _rotary_refusals(report)
    assert len(refusals) == 2 and all(reason in r for r in refusals), refusals


def test_rotary_disabled_leaves_the_partial_rotary_alone(npu_ops, rewritten):
    inputs = _rope_inputs(256, 64)
    eager = _run(_rope, inputs, False)
    compiled = _run(torch.compile(_rope, backend="qwen_npu", options={"fusions": "attention"}), inputs, False)
    for got, want in zip(compiled[0], eager[0]):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    [report] = get_reports()
    assert "rotary" not in report.fusions and report.variants == {}
    [gm] = rewritten
    assert not gm.graph.find_nodes(op="call_function", target=NPU.npu_rotary_mul.default)
