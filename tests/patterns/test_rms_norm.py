"""RMSNorm -> ``npu_rms_norm`` (and residual add + RMSNorm -> ``npu_add_rms_norm`` in graphs without
autograd) on transformers' real Qwen2 modeling code: exact counts (with SwiGLU, its MLP neighbour) and
parity, and the negatives: an intermediate used outside the norm, a dtype pair outside the kernel,
strict mode."""

import contextlib
import copy
import logging

import pytest
import torch
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

from qwen_npu_compile import get_reports
from qwen_npu_compile.cli.check.models import tiny_qwen2
from qwen_npu_compile.cli.check.parity import FP32_TOLERANCE, judge_parity
from tests.helpers.numerics import assert_parity

LAYERS = 2
CORE = {"fusions": "rms_norm,swiglu"}


#: Every dtype x mode statically; under dynamic=True (eps and sizes become graph inputs) each RMSNorm
#: variant (half, fp32) and each graph kind (autograd: npu_rms_norm; inference: npu_add_rms_norm) once.
SETTINGS = [(dtype, train, False) for dtype in (torch.float32, torch.bfloat16) for train in (True, False)] + [
    (torch.bfloat16, True, True),
    (torch.float32, False, True),
]


@pytest.mark.parametrize(
    "dtype, train, dynamic", SETTINGS,
    ids=[f"{'bf16' if d is torch.bfloat16 else 'fp32'}-{'train' if t else 'infer'}-{'dynamic' if y else 'static'}"
         for d, t, y in SETTINGS],
)  # fmt: skip
def test_exact_counts_and_parity(npu_ops, dtype, train, dynamic):
    model = tiny_qwen2(dtype).train(train)
    input_ids = torch.randint(0, 128, (2, 16))
    reports = assert_parity(model, input_ids, train, dtype, options=CORE, dynamic=dynamic or None)
    assert len(reports) == 1
    report = reports[0]
    assert report.simulated is True
    assert report.fusions == {"rms_norm": 2 * LAYERS + 1, "swiglu": LAYERS}
    assert [r for r in report.refused if r.family in report.families] == []
    if train:
        assert report.aot_ops["forward"] == {"npu_rms_norm": 2 * LAYERS + 1, "npu_swiglu": LAYERS}
    else:  # inference graph: 2L norms follow a residual add (patterns/rms_norm.py)
        assert report.aot_ops["forward"] == {"npu_rms_norm": 1, "npu_add_rms_norm": 2 * LAYERS, "npu_swiglu": LAYERS}
    if train:
        assert report.aot_ops["backward"] == {"npu_rms_norm_backward": 2 * LAYERS + 1, "npu_swiglu_backward": LAYERS}
    else:
        assert "backward" not in report.aot_ops


def test_dynamic_sequence_length_reuses_one_graph(npu_ops):
    model = tiny_qwen2(torch.bfloat16).eval()
    compiled = torch.compile(model, backend="qwen_npu", options=CORE, dynamic=True)
    with torch.no_grad():
        for seq_len in (8, 13, 21):
            ids = torch.randint(0, 128, (1, seq_len))
            torch.testing.assert_close(compiled(ids).logits, model(ids).logits, atol=5e-2, rtol=5e-2)
    assert [r.fusions for r in get_reports()] == [{"rms_norm": 5, "swiglu": 2}]


def test_bf16_activations_with_fp32_norm_weight_keep_hf_promotion(npu_ops):
    """vllm #48324: bf16 input with fp32 weight; HF returns fp32 there, so must the fused graph."""
    norm = Qwen2RMSNorm(64, eps=1e-6)  # fp32 weight
    torch.nn.init.normal_(norm.weight)
    x = torch.randn(2, 8, 64, dtype=torch.bfloat16)
    eager = norm(x)
    compiled = torch.compile(norm, backend="qwen_npu", options=CORE)(x)
    assert compiled.dtype == eager.dtype == torch.float32
    torch.testing.assert_close(compiled, eager, atol=3e-2, rtol=1e-2)
    assert [r.fusions["rms_norm"] for r in get_reports()] == [1]


@pytest.mark.stack_compat
@pytest.mark.parametrize("eps", [1e-5, 0.25])
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_any_eps_fuses_with_its_own_value(npu_ops, eps, dynamic):
    """Llama's and Mistral's 1e-5 (not the tracing's magic 1e-6) fuse on every stack (torch 2.9's check sees
    a match without the eps keyword), and the fused op uses that eps: at 0.25 a 1e-6 would differ by ~10%."""
    norm = Qwen2RMSNorm(64, eps=eps)
    torch.nn.init.normal_(norm.weight)
    x = 0.3 * torch.randn(2, 8, 64)
    compiled = torch.compile(norm, backend="qwen_npu", options=CORE, dynamic=dynamic or None)(x)
    torch.testing.assert_close(compiled, norm(x), atol=1e-5, rtol=1e-5)
    assert [(r.fusions["rms_norm"], r.refused) for r in get_reports()] == [(1, [])]


# --- negatives --------------------------------------------------------------------------------------


class RmsNormLeakingIntermediate(torch.nn.Module):
    """Qwen2RMSNorm's math, but the normalised fp32 activation is also returned."""

    def __init__(self, hidden=32):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(hidden))

    def forward(self, x):
        h = x.to(torch.float32)
        normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * normed.to(x.dtype), normed


def test_intermediate_used_outside_rms_norm_is_not_fused(npu_ops, caplog):
    module = RmsNormLeakingIntermediate()
    x = torch.randn(2, 4, 32)
    with caplog.at_level(logging.WARNING, logger="qwen_npu_compile"):
        out, normed = torch.compile(module, backend="qwen_npu", options=CORE)(x)
    ref_out, ref_normed = module(x)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(normed, ref_normed)
    [report] = get_reports()
    assert report.fusions["rms_norm"] == 0
    (refusal,) = [r for r in report.refused if r.family == "rms_norm"]
    assert "used outside" in refusal.reason
    assert refusal.source.startswith("test_rms_norm.py:")
    assert "QWEN_NPU_DUMP_DIR" in caplog.text and "rms_norm" in caplog.text


def test_rms_norm_dtype_pair_outside_the_kernel_is_refused(npu_ops):
    norm = Qwen2RMSNorm(32).to(torch.bfloat16)
    x = torch.randn(2, 4, 32, dtype=torch.float16)
    out = torch.compile(norm, backend="qwen_npu", options=CORE)(x)
    torch.testing.assert_close(out, norm(x))
    [report] = get_reports()
    assert report.fusions["rms_norm"] == 0
    (refusal,) = report.refused
    assert refusal.family == "rms_norm"
    assert "unsupported dtype pair" in refusal.reason and "float16" in refusal.reason
    assert refusal.source.startswith("modeling_qwen2.py:")


def test_strict_mode_names_family_reason_and_source(npu_ops):
    module = RmsNormLeakingIntermediate()
    with pytest.raises(Exception, match=r"strict mode(.|\n)*rms_norm: near miss(.|\n)*test_rms_norm.py:\d+"):
        torch.compile(module, backend="qwen_npu", options={**CORE, "strict": True})(torch.randn(2, 4, 32))


# --- residual add + RMSNorm -> npu_add_rms_norm (inference graphs) ------------------------------------


def _forward_ops(model, ids, context):
    with context():
        expected = model(input_ids=ids).logits
        reference = None if expected.dtype == torch.float32 else copy.deepcopy(model).float()(input_ids=ids).logits
        actual = torch.compile(model, backend="qwen_npu")(input_ids=ids).logits
    reports = get_reports()
    assert len(reports) == 1
    return reports[0], judge_parity(actual.detach(), expected.detach(), reference, FP32_TOLERANCE["logits"])


@pytest.mark.parametrize("context", [torch.no_grad, torch.inference_mode], ids=["no_grad", "inference_mode"])
def test_fp32_inference_fuses_2L_exact_and_parity(npu_ops, context):
    """2L = 4: every norm but layer 0's input norm (its input is the embedding) follows a residual add."""
    report, parity = _forward_ops(tiny_qwen2(torch.float32).eval(), torch.randint(0, 128, (2, 16)), context)
    assert report.fusions["rms_norm"] == 2 * LAYERS + 1  # family count unchanged: 2L+1 norms fused
    assert report.aot_ops["forward"]["npu_add_rms_norm"] == 2 * LAYERS
    assert report.aot_ops["forward"]["npu_rms_norm"] == 1
    assert parity["ok"], parity


def test_frozen_parameters_count_as_inference(npu_ops):
    model = tiny_qwen2(torch.float32).eval()
    model.requires_grad_(False)
    report, parity = _forward_ops(model, torch.randint(0, 128, (2, 16)), contextlib.nullcontext)
    assert report.aot_ops["forward"]["npu_add_rms_norm"] == 2 * LAYERS and parity["ok"], parity


def test_bf16_inference_parity(npu_ops):
    report, parity = _forward_ops(tiny_qwen2(torch.bfloat16).eval(), torch.randint(0, 128, (2, 16)), torch.no_grad)
    assert report.aot_ops["forward"]["npu_add_rms_norm"] == 2 * LAYERS
    assert parity["ok"] and "compiled_rel_l2_to_fp32" in parity, parity


def test_graphs_with_autograd_keep_npu_rms_norm(npu_ops):
    """eval() with grad enabled and trainable parameters may still be differentiated: no add fusion."""
    report, _ = _forward_ops(tiny_qwen2(torch.float32).eval(), torch.randint(0, 128, (2, 16)), contextlib.nullcontext)
    assert report.aot_ops["forward"].get("npu_add_rms_norm", 0) == 0
    assert report.aot_ops["forward"]["npu_rms_norm"] == 2 * LAYERS + 1
    assert report.refused == [] or all(r.family != "rms_norm" for r in report.refused)


class _AddNorm(torch.nn.Module):
    def __init__(self, weight_dtype):
        super().__init__()
        self.norm = Qwen2RMSNorm(64).to(weight_dtype)

    def forward(self, residual, h):
        total = residual + h
        return self.norm(total), total


@pytest.mark.parametrize("weight_dtype,merged", [(torch.float32, 0), (torch.bfloat16, 1)])
def test_gamma_dtype_decides(npu_ops, weight_dtype, merged):
    """The contract wants gamma in x1's dtype: bf16 activations with an fp32 weight keep npu_rms_norm."""
    module = _AddNorm(weight_dtype)
    torch.nn.init.normal_(module.norm.weight)
    a, b = torch.randn(2, 8, 64, dtype=torch.bfloat16), torch.randn(2, 8, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        expected = module(a, b)
        actual = torch.compile(module, backend="qwen_npu", options={"fusions": "rms_norm"})(a, b)
    (report,) = get_reports()
    assert report.fusions["rms_norm"] == 1
    assert report.aot_ops["forward"].get("npu_add_rms_norm", 0) == merged
    assert actual[0].dtype == expected[0].dtype
    torch.testing.assert_close(actual[1], expected[1], atol=0, rtol=0)  # the residual sum is exact
    torch.testing.assert_close(actual[0], expected[0], atol=3e-2, rtol=2e-2)


def test_limits_map_the_node(npu_ops):
    from qwen_npu_compile.ops.limits import CHECKS

    x = torch.empty(2, 8, 64)
    assert CHECKS["npu::npu_add_rms_norm"]({"x1": x, "x2": x, "gamma": torch.empty(64)}, "torchair") is None
