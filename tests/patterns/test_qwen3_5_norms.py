"""Qwen3.5 / Qwen3.5-MoE / Qwen3-Next norms on transformers' real modeling code (tiny random configs):
the (1 + w) RMSNorm (``rms_norm``'s ``rms_norm_one_plus_weight_*`` variants: input, post-attention, final,
q_norm/k_norm) and the Gated DeltaNet's gated RMSNorm (``rms_norm_gated``). Exact counts from
``expected_fusions``, forward and backward parity against eager in fp32 and bf16, the AOT graphs' fused
ops, and the negatives: an intermediate reused, a dtype mismatch, the family disabled."""

from __future__ import annotations

import pytest
import torch
import transformers

pytest.importorskip("transformers.models.qwen3_5", reason="Qwen3.5 needs transformers >= 5")
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm, Qwen3_5RMSNormGated

from qwen_npu_compile import get_reports
from qwen_npu_compile.patterns import expected_fusions
from tests.helpers.models import token_ids
from tests.helpers.numerics import assert_parity

NORMS = {"fusions": "rms_norm_gated,rms_norm"}

#: 2 decoder layers: one Gated DeltaNet (linear-attention) layer, one full-attention layer.
HYBRID = ["linear_attention", "full_attention"]
_COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
               linear_key_head_dim=16, linear_value_head_dim=16, layer_types=HYBRID, use_cache=False)  # fmt: skip
_MOE = dict(moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2)

MODELS = {
    "qwen3_5": lambda: (transformers.Qwen3_5TextConfig(**_COMMON), transformers.Qwen3_5ForCausalLM),
    "qwen3_5_moe": lambda: (transformers.Qwen3_5MoeTextConfig(**_COMMON, **_MOE), transformers.Qwen3_5MoeForCausalLM),
    "qwen3_next": lambda: (transformers.Qwen3NextConfig(**_COMMON, **_MOE), transformers.Qwen3NextForCausalLM),
}


def tiny(name: str, dtype=torch.float32, layer_types=HYBRID):
    """A tiny model of ``MODELS[name]`` in ``dtype`` with random non-zero norm weights (HF initialises the
    (1 + w) weights to zeros and the gated norm's to ones)."""
    config, cls = MODELS[name]()
    config.layer_types = list(layer_types)
    torch.manual_seed(0)
    model = cls._from_config(config, attn_implementation="sdpa")
    with torch.no_grad():
        for module_name, param in model.named_parameters():
            if "norm" in module_name:
                param.normal_(0.0 if module_name.endswith("norm.weight") and "linear_attn" not in module_name else 1.0, 0.5)
    return model.to(dtype)


# --- expected counts ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(MODELS))
def test_expected_counts_per_layer_kind(name):
    config, _ = MODELS[name]()
    config.num_hidden_layers, config.layer_types = 4, ["linear_attention"] * 3 + ["full_attention"]
    counts = expected_fusions(config, ["rms_norm", "rms_norm_gated"])
    assert counts == {"rms_norm_gated": 3, "rms_norm": 3 * 2 + 4 + 1}
    linear = expected_fusions(config, ["rms_norm", "rms_norm_gated"], per_layer=True, layer_type="linear_attention")
    full = expected_fusions(config, ["rms_norm", "rms_norm_gated"], per_layer=True, layer_type="full_attention")
    assert linear == {"rms_norm_gated": 1, "rms_norm": 2}
    assert full == {"rms_norm_gated": 0, "rms_norm": 4}
    config.layer_types = ["full_attention"] * 4  # no linear layer: layer kinds read as None
    assert expected_fusions(config, ["rms_norm", "rms_norm_gated"]) == {"rms_norm_gated": 0, "rms_norm": 4 * 4 + 1}


# --- counts and parity on the whole model ------------------------------------------------------------


def _norm_source_lines(model) -> set[str]:
    """``"modeling_<x>.py:<line>"`` for every line of the model's (1 + w) and gated RMSNorm classes."""
    import inspect
    import os

    lines = set()
    for module in model.modules():
        if type(module).__name__.endswith(("RMSNorm", "RMSNormGated")):
            source, start = inspect.getsourcelines(type(module))
            name = os.path.basename(inspect.getsourcefile(type(module)))
            lines |= {f"{name}:{start + i}" for i in range(len(source))}
    return lines


def _check_report(report, model, train: bool):
    want = expected_fusions(model.config, ["rms_norm", "rms_norm_gated"])
    assert want == {"rms_norm_gated": 1, "rms_norm": 2 + 4 + 1}
    assert {k: report.fusions[k] for k in want} == want
    # no refusal inside a norm class (the DeltaNet's l2norm, an rsqrt but no RMSNorm, may be a near miss)
    refused = [r.source for r in report.refused if r.family in want]
    assert not set(refused) & _norm_source_lines(model), report.refused
    forward = report.aot_ops["forward"]
    assert forward.get("npu_swiglu", 0) == want["rms_norm_gated"]
    assert forward.get("npu_rms_norm", 0) + forward.get("npu_add_rms_norm", 0) == sum(want.values())
    if train:
        assert report.aot_ops["backward"] == {"npu_rms_norm_backward": sum(want.values()),
                                              "npu_swiglu_backward": want["rms_norm_gated"]}


#: (model, dtype, train): training parity in bf16 and fp32, the MoE model's forward; fp32 no-grad below.
SETTINGS = [("qwen3_5", torch.bfloat16, True), ("qwen3_next", torch.float32, True), ("qwen3_5_moe", torch.bfloat16, False)]


@pytest.mark.parametrize("name, dtype, train", SETTINGS,
                         ids=[f"{n}-{'bf16' if d is torch.bfloat16 else 'fp32'}-{'train' if t else 'no_grad'}"
                              for n, d, t in SETTINGS])  # fmt: skip
def test_hybrid_counts_and_parity(npu_ops, name, dtype, train):
    model = tiny(name, dtype).train(train)
    [report] = assert_parity(model, token_ids(seq=16), train, dtype, options=NORMS)
    _check_report(report, model, train)
    half = "half" if dtype is torch.bfloat16 else "fp32"
    assert report.variants == {f"rms_norm_gated_{half}": 1, f"rms_norm_one_plus_weight_{half}": 7}


def test_fp32_inference_merges_residual_adds(npu_ops):
    """No autograd: the 4 (1 + w) norms after a residual add (all but layer 0's input norm and the q/k norms)
    become npu_add_rms_norm, their fp32 gamma ``1 + w`` hoisted above the add."""
    model = tiny("qwen3_5", torch.float32).eval()
    with torch.no_grad():
        [report] = assert_parity(model, token_ids(seq=16), False, torch.float32, options=NORMS)
    _check_report(report, model, False)
    assert report.aot_ops["forward"] == {"npu_add_rms_norm": 4, "npu_rms_norm": 4, "npu_swiglu": 1}


# --- standalone modules: the autocast dtype pair and the negatives -----------------------------------

def _norm(dtype=torch.float32):
    norm = Qwen3_5RMSNorm(32, eps=1e-6)
    torch.nn.init.normal_(norm.weight, 0.0, 0.5)
    return norm.to(dtype)


def _gated(dtype=torch.float32):
    norm = Qwen3_5RMSNormGated(32, eps=1e-6)
    torch.nn.init.normal_(norm.weight, 1.0, 0.5)
    return norm.to(dtype)


def _fused(module, *args, fusions="rms_norm_gated,rms_norm"):
    out = torch.compile(module, backend="qwen_npu", options={"fusions": fusions})(*args)
    [report] = get_reports()
    return out, report


@pytest.mark.parametrize("fusions, gated, norm", [("rms_norm_gated,rms_norm", 1, 0), ("rms_norm_gated", 1, None),
                                                  ("rms_norm", None, 0)])
def test_gated_norm_autocast_dtypes_and_disabled_family(npu_ops, fusions, gated, norm):
    """bf16 h and gate with an fp32 weight (autocast): fused (eager's fp32 product is rounded once more);
    with rms_norm_gated disabled, rms_norm refuses the gated norm's inner norm (left whole)."""
    module = _gated(torch.float32)
    h, gate = torch.randn(8, 32, dtype=torch.bfloat16), torch.randn(8, 32, dtype=torch.bfloat16)
    out, report = _fused(module, h, gate, fusions=fusions)
    expected = module(h, gate)
    assert out.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)
    assert report.fusions.get("rms_norm_gated") == gated and report.fusions.get("rms_norm") == norm
    if norm is not None and gated is None:
        [refusal] = [r for r in report.refused if r.family == "rms_norm"]
        assert "gated RMSNorm" in refusal.reason and refusal.source.startswith("modeling_qwen3_5.py:")


def test_gated_norm_dtype_mismatch_is_refused(npu_ops):
    """fp16 h with a bf16 gate: npu_swiglu takes one tensor, so the halves must share a dtype."""
    module = _gated(torch.float16)
    h, gate = torch.randn(8, 32, dtype=torch.float16), torch.randn(8, 32, dtype=torch.bfloat16)
    out, report = _fused(module, h, gate)
    torch.testing.assert_close(out, module(h, gate))
    assert report.fusions["rms_norm_gated"] == 0
    [refusal] = [r for r in report.refused if r.family == "rms_norm_gated"]
    assert "dtype mismatch" in refusal.reason and refusal.source.startswith("modeling_qwen3_5.py:")


class GatedLeakingGate(torch.nn.Module):
    """Qwen3_5RMSNormGated's math, but silu(gate) is also returned."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(32))

    def forward(self, h, gate):
        hidden = h.to(torch.float32)
        hidden = self.weight * (hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + 1e-6)).to(h.dtype)
        gated = torch.nn.functional.silu(gate.to(torch.float32))
        return (hidden * gated).to(h.dtype), gated


class OnePlusLeakingNorm(torch.nn.Module):
    """Qwen3_5RMSNorm's math, but the normalised fp32 activation is also returned."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(32))

    def forward(self, x):
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
        return (normed * (1.0 + self.weight.float())).type_as(x), normed


def test_gated_norm_intermediate_used_outside_is_not_fused(npu_ops):
    module = GatedLeakingGate()
    h, gate = torch.randn(8, 32), torch.randn(8, 32)
    out, report = _fused(module, h, gate)
    torch.testing.assert_close(out, module(h, gate))
    assert report.fusions == {"rms_norm_gated": 0, "rms_norm": 0}
    reasons = {r.family: r.reason for r in report.refused}
    assert "used outside" in reasons["rms_norm_gated"] and "gated RMSNorm" in reasons["rms_norm"]


def test_one_plus_weight_intermediate_used_outside_is_not_fused(npu_ops):
    module = OnePlusLeakingNorm()
    x = torch.randn(2, 4, 32, dtype=torch.bfloat16)
    out, report = _fused(module, x)
    torch.testing.assert_close(out, module(x))
    assert report.fusions["rms_norm"] == 0
    [refusal] = [r for r in report.refused if r.family == "rms_norm"]
    assert "used outside" in refusal.reason and refusal.source.startswith("test_qwen3_5_norms.py:")


def test_one_plus_weight_dtype_outside_the_kernel_is_refused(npu_ops):
    """A float64 x: (float64, fp32) is no npu_rms_norm dtype pair."""
    module = _norm(torch.float64)
    x = torch.randn(2, 4, 32, dtype=torch.float64)
    out, report = _fused(module, x)
    torch.testing.assert_close(out, module(x))
    assert report.fusions["rms_norm"] == 0
    [refusal] = [r for r in report.refused if r.family == "rms_norm"]
    assert "unsupported dtype pair" in refusal.reason and "float64" in refusal.reason


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_one_plus_weight_bf16_x_fp32_weight(npu_ops, dtype):
    """x in ``dtype`` with an fp32 weight (autocast's q_norm/k_norm): gamma = 1 + w in fp32; eps kept."""
    module = Qwen3_5RMSNorm(32, eps=0.25)
    torch.nn.init.normal_(module.weight, 0.0, 0.5)
    x = torch.randn(2, 4, 32, dtype=dtype)
    out, report = _fused(module, x)
    assert out.dtype == dtype
    torch.testing.assert_close(out, module(x), atol=0 if dtype is torch.bfloat16 else 1e-6, rtol=1e-5)
    assert report.fusions["rms_norm"] == 1
