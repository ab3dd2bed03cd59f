"""npu_add_rms_norm (issue 12): the stand-in, its limits, and the inference-only rewrite on a tiny Qwen2."""

import contextlib
import copy

import pytest
import torch

from qwen_npu_compile.check.models import tiny_qwen2
from qwen_npu_compile.check.parity import FP32_TOLERANCE, judge_parity

npu = torch.ops.npu
LAYERS = 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_reference_matches_add_then_rms_norm(simulated_npu_ops, dtype):
    x1, x2 = torch.randn(2, 8, 64, dtype=dtype), torch.randn(2, 8, 64, dtype=dtype)
    gamma = torch.randn(64, dtype=dtype)
    y, rstd, s = npu.npu_add_rms_norm.default(x1, x2, gamma, 1e-6)
    total = x1.float() + x2.float()
    expected_rstd = torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + 1e-6)
    assert rstd.dtype == torch.float32 and rstd.shape == (2, 8, 1)
    assert y.dtype == s.dtype == dtype
    torch.testing.assert_close(s, total.to(dtype), atol=0, rtol=0)
    torch.testing.assert_close(rstd, expected_rstd)
    torch.testing.assert_close(y, (total * expected_rstd * gamma.float()).to(dtype), atol=0, rtol=0)


def test_fake_kernel_shapes(simulated_npu_ops):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(3, 5, 32, dtype=torch.bfloat16)
        y, rstd, s = npu.npu_add_rms_norm.default(x, x, torch.empty(32, dtype=torch.bfloat16))
    assert (y.shape, rstd.shape, s.shape, rstd.dtype) == ((3, 5, 32), (3, 5, 1), (3, 5, 32), torch.float32)


@pytest.mark.parametrize(
    "x1,x2,gamma,needs_grad,reason",
    [
        ((2, 8, 64), (2, 8, 64), (64,), True, "no backward"),
        ((2, 8, 64), (1, 8, 64), (64,), False, "differ in shape"),
        ((2, 8, 64), (2, 8, 64), (32,), False, "gamma shape"),
        ((2, 0, 64), (2, 0, 64), (64,), False, "empty"),
    ],
)
def test_violations(x1, x2, gamma, needs_grad, reason):
    from qwen_npu_compile.npu_ops.add_rms_norm import add_rms_norm_violation

    found = add_rms_norm_violation(torch.empty(x1), torch.empty(x2), torch.empty(gamma), needs_grad=needs_grad)
    assert found is not None and reason in found


def test_violation_gamma_dtype_must_equal_x1():
    from qwen_npu_compile.npu_ops.add_rms_norm import add_rms_norm_violation

    x = torch.empty(2, 8, 64, dtype=torch.bfloat16)
    assert "gamma's must equal x1's" in add_rms_norm_violation(x, x, torch.empty(64))
    assert add_rms_norm_violation(x, x, torch.empty(64, dtype=torch.bfloat16)) is None


def _forward_ops(model, ids, context):
    from qwen_npu_compile import get_reports

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
        from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

        self.norm = Qwen2RMSNorm(64).to(weight_dtype)

    def forward(self, residual, h):
        total = residual + h
        return self.norm(total), total


@pytest.mark.parametrize("weight_dtype,merged", [(torch.float32, 0), (torch.bfloat16, 1)])
def test_gamma_dtype_decides(npu_ops, weight_dtype, merged):
    """The contract wants gamma in x1's dtype: bf16 activations with an fp32 weight keep npu_rms_norm."""
    from qwen_npu_compile import get_reports

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
    from qwen_npu_compile.npu_ops.limits import CHECKS

    x = torch.empty(2, 8, 64)
    assert CHECKS["npu::npu_add_rms_norm"]({"x1": x, "x2": x, "gamma": torch.empty(64)}, "torchair") is None
