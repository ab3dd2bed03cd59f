"""``strict`` has no false positives: every dense preset of ``check`` (as a tiny model of its family,
2 layers, with the preset's own family fields: tying, RMSNorm eps, RoPE base and scaling, sliding window,
q/k/v bias, head_dim) and a tiny Qwen2.5-VL text model compile with ``strict=True`` (bf16 training,
whole model), fuse exactly what the config says, and match eager (``check``'s parity rule).

Presets whose tiny versions are identical (the Qwen2 sizes differ only in shapes) are one case, named
after all of them. The MoE presets are the MoE tests' (their router softmax is a family of its own).
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from qwen_npu_compile import ALL_FAMILIES
from qwen_npu_compile.cli.check import models, presets
from qwen_npu_compile.cli.check.model_types import HYBRID_MODEL_TYPES
from qwen_npu_compile.patterns import expected_fusions
from qwen_npu_compile.report import SUMMARY
from tests.helpers.numerics import assert_parity

LAYERS = 2
#: Family fields a tiny version keeps from its preset (everything else is made small).
KEPT = ("model_type", "tie_word_embeddings", "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters",
        "sliding_window", "use_sliding_window", "attention_bias", "mlp_bias", "hidden_act")


def tiny_version(name: str):
    """The preset ``name`` as a tiny model config: 2 heads of 64 (Qwen3: 128, as its presets), 1 KV head
    (GQA), hidden 128, intermediate 256, vocab 512, 2 layers; the family fields of :data:`KEPT` as published."""
    data = models.resolve_model_config(name).to_dict()
    head_dim = 128 if data.get("model_type") == "qwen3" else 64
    data.update(hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=1, head_dim=head_dim,
                vocab_size=512, num_hidden_layers=LAYERS, max_window_layers=LAYERS, use_cache=False)
    if isinstance(data.get("layer_types"), list):
        data["layer_types"] = data["layer_types"][:LAYERS]
    if not data.get("use_sliding_window") and data.get("model_type") == "qwen2":
        data["sliding_window"] = None  # unused (use_sliding_window False): presets differing only here are one case
    return type(models.resolve_model_config(name)).from_dict(data)


def _dense_cases() -> list:
    groups: dict[str, list[str]] = {}
    for name in models.preset_names():
        if presets.PRESETS[name].get("model_type") in HYBRID_MODEL_TYPES:
            continue  # (resolving them needs transformers >= 5 for Qwen3.5)
        config = tiny_version(name)
        if "moe" in config.model_type or config.model_type in HYBRID_MODEL_TYPES:
            continue  # MoE: test_moe.py; hybrid (Gated DeltaNet) models: test_hybrid_models.py, test_hybrid_presets.py
        key = json.dumps({field: getattr(config, field, None) for field in KEPT}, sort_keys=True, default=str)
        groups.setdefault(key, []).append(name)
    return [pytest.param(names[0], id="+".join(names)) for names in groups.values()]


@pytest.mark.parametrize("preset", _dense_cases())
def test_strict_passes_on_every_dense_preset(preset, npu_ops):
    config = tiny_version(preset)
    torch.manual_seed(0)
    model = models._model_class(config)._from_config(config, attn_implementation="sdpa").to(torch.bfloat16).train()
    input_ids = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    (report,) = assert_parity(model, input_ids, True, torch.bfloat16, options={"strict": True})
    assert report.fallback is None and report.downstream_fallbacks == []
    assert [r for r in report.refused if r.family in report.families] == [], report.refused
    want = expected_fusions(model.config)
    assert {family: report.fusions.get(family, 0) for family in want} == want, report.fusions


def tiny_qwen2_5_vl_text_config():
    """A tiny Qwen2.5-VL text config: 2 layers, 2 heads of 64, 1 KV head, q/k/v bias, mRoPE sections
    ``[8, 12, 12]`` (they add up to head_dim / 2, as the published ``[16, 24, 24]`` for 128)."""
    rope = {"type": "mrope", "rope_type": "default", "mrope_section": [8, 12, 12], "rope_theta": 1000000.0}
    fields = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=LAYERS, num_attention_heads=2,
                  num_key_value_heads=1, vocab_size=512, max_position_embeddings=512, rms_norm_eps=1e-6,
                  use_cache=False, attention_dropout=0.0)
    if int(transformers.__version__.split(".")[0]) >= 5:
        return transformers.Qwen2_5_VLTextConfig(**fields, rope_parameters=rope)
    # transformers 4.x names it rope_scaling (and keeps an unknown rope_parameters as a plain attribute)
    return transformers.Qwen2_5_VLTextConfig(**fields, rope_scaling=dict(rope), rope_theta=1000000.0)


def test_strict_passes_on_a_tiny_qwen2_5_vl_text_model(npu_ops):
    config = tiny_qwen2_5_vl_text_config()
    torch.manual_seed(0)
    model = transformers.Qwen2_5_VLTextModel._from_config(config, attn_implementation="sdpa").train()
    input_ids = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))

    def step(runner):
        model.zero_grad(set_to_none=True)
        hidden = runner(input_ids=input_ids, use_cache=False).last_hidden_state
        hidden.square().mean().backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
        return hidden.detach(), grads

    expected = step(model)
    actual = step(torch.compile(model, backend="qwen_npu", options={"strict": True}))
    torch.testing.assert_close(actual[0], expected[0], rtol=1e-5, atol=1e-5)
    assert actual[1].keys() == expected[1].keys()
    for name in expected[1]:
        torch.testing.assert_close(actual[1][name], expected[1][name], rtol=1e-4, atol=1e-5)
    (report,) = SUMMARY.graphs
    assert report.fallback is None and [r for r in report.refused if r.family in report.families] == []
    fused = {family: report.fusions.get(family, 0) for family in ALL_FAMILIES if family not in ("moe", "rms_norm_gated", "gated_delta_rule")}
    # per layer 2 RMSNorms, 1 SwiGLU, rotary of q and k, 1 attention; the final norm
    assert fused == {"rms_norm": 2 * LAYERS + 1, "swiglu": LAYERS, "rotary": 2 * LAYERS, "attention": LAYERS}, fused
