"""npu_add_rms_norm: the stand-in and its limits. The inference-only rewrite of residual add +
RMSNorm on a tiny Qwen2 is tested with its family, tests/patterns/test_rms_norm.py."""

import pytest
import torch

npu = torch.ops.npu


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
    from qwen_npu_compile.ops.torch_npu.add_rms_norm import add_rms_norm_violation

    found = add_rms_norm_violation(torch.empty(x1), torch.empty(x2), torch.empty(gamma), needs_grad=needs_grad)
    assert found is not None and reason in found


def test_violation_gamma_dtype_must_equal_x1():
    from qwen_npu_compile.ops.torch_npu.add_rms_norm import add_rms_norm_violation

    x = torch.empty(2, 8, 64, dtype=torch.bfloat16)
    assert "gamma's must equal x1's" in add_rms_norm_violation(x, x, torch.empty(64))
    assert add_rms_norm_violation(x, x, torch.empty(64, dtype=torch.bfloat16)) is None
