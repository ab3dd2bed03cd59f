"""The npu_rms_norm / npu_swiglu stand-ins against plain reference math (Liger-style per-op tests)."""

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

npu = torch.ops.npu
pytestmark = pytest.mark.usefixtures("simulated_npu_ops")


def hf_rms_norm(x, w, eps):
    """transformers Qwen2RMSNorm.forward, verbatim math."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


@pytest.mark.parametrize("shape", [(2, 8, 64), (1, 1, 896), (3, 5, 7, 48)])
@pytest.mark.parametrize("x_dtype,w_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                             (torch.bfloat16, torch.float32), (torch.float16, torch.float16)])
def test_rms_norm_forward_matches_reference(npu_ops, shape, x_dtype, w_dtype):
    x = torch.randn(shape, dtype=x_dtype)
    w = torch.randn(shape[-1], dtype=w_dtype)
    y, rstd = npu.npu_rms_norm.default(x, w, 1e-6)
    assert y.dtype == x_dtype and y.shape == x.shape
    assert rstd.dtype == torch.float32 and rstd.shape == (*shape[:-1], 1)
    expected_rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(rstd, expected_rstd)
    exact = (x.float() * expected_rstd * w.float())  # fp32 math, rounded once by the kernel
    torch.testing.assert_close(y, exact.to(x_dtype), atol=0, rtol=0)
    tol = 1e-5 if x_dtype == torch.float32 else 1.6e-2  # HF rounds before the weight multiply: ~1 ulp
    torch.testing.assert_close(y.to(hf_rms_norm(x, w, 1e-6).dtype), hf_rms_norm(x, w, 1e-6), atol=tol * 4, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_backward_matches_autograd(npu_ops, dtype):
    x = torch.randn(4, 6, 32, dtype=dtype, requires_grad=True)
    w = torch.randn(32, dtype=dtype, requires_grad=True)
    dy = torch.randn(4, 6, 32, dtype=dtype)
    y, _ = npu.npu_rms_norm.default(x, w, 1e-5)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    xr, wr = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    yr = xr * torch.rsqrt(xr.pow(2).mean(-1, keepdim=True) + 1e-5) * wr
    dxr, dwr = torch.autograd.grad(yr, (xr, wr), dy.double())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(dx.double(), dxr, atol=tol, rtol=tol)
    torch.testing.assert_close(dw.double(), dwr, atol=tol * 10, rtol=tol)
    assert dx.dtype == dtype and dw.dtype == dtype
    # the backward op itself: dgamma is always fp32 (torch_npu 2.13.0 docs)
    _, rstd = npu.npu_rms_norm.default(x.detach(), w.detach(), 1e-5)
    dx_op, dgamma_op = npu.npu_rms_norm_backward.default(dy, x.detach(), w.detach(), rstd)
    assert dx_op.dtype == dtype and dgamma_op.dtype == torch.float32


def test_rms_norm_rejects_unsupported_dtype_pair(npu_ops):
    with pytest.raises(RuntimeError, match="unsupported dtype pair"):
        npu.npu_rms_norm.default(torch.randn(2, 8, dtype=torch.float16), torch.randn(8, dtype=torch.bfloat16))


def test_rms_norm_fake_kernel(npu_ops):
    with FakeTensorMode():
        y, rstd = npu.npu_rms_norm.default(torch.empty(2, 3, 16, dtype=torch.bfloat16), torch.empty(16), 1e-6)
    assert (y.shape, y.dtype) == ((2, 3, 16), torch.bfloat16)
    assert (rstd.shape, rstd.dtype) == ((2, 3, 1), torch.float32)


@pytest.mark.parametrize("shape", [(2, 8, 64), (1, 1, 4864), (3, 5, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_swiglu_forward_backward(npu_ops, shape, dtype):
    gate = torch.randn(shape, dtype=dtype, requires_grad=True)
    up = torch.randn(shape, dtype=dtype, requires_grad=True)
    out = npu.npu_swiglu.default(torch.cat([gate, up], -1), -1)
    expected = F.silu(gate.float()) * up.float()
    assert out.dtype == dtype and out.shape == shape
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)
    dy = torch.randn(shape, dtype=dtype)
    dg, du = torch.autograd.grad(out, (gate, up), dy)
    g64, u64 = gate.detach().double().requires_grad_(), up.detach().double().requires_grad_()
    dg_ref, du_ref = torch.autograd.grad(F.silu(g64) * u64, (g64, u64), dy.double())
    torch.testing.assert_close(dg.double(), dg_ref, atol=tol * 4, rtol=tol * 4)
    torch.testing.assert_close(du.double(), du_ref, atol=tol * 4, rtol=tol * 4)


def test_swiglu_split_dim_and_contract_errors(npu_ops):
    x = torch.randn(4, 6, 3)
    out = npu.npu_swiglu.default(x, 1)  # split along dim 1: A = x[:, :3], B = x[:, 3:]
    torch.testing.assert_close(out, F.silu(x[:, :3]) * x[:, 3:])
    with pytest.raises(RuntimeError, match="non-contiguous"):
        npu.npu_swiglu.default(torch.randn(8, 4).t(), -1)
    with pytest.raises(RuntimeError, match="even"):
        npu.npu_swiglu.default(torch.randn(2, 5), -1)


# Verbatim from torch_npu 2.13.0 npu_native_functions_by_codegen.yaml (docs/npu-op-contracts.md).
CONTRACT_SCHEMAS = [
    "npu_rms_norm(Tensor self, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor)",
    "npu_rms_norm_backward(Tensor dy, Tensor self, Tensor gamma, Tensor rstd) -> (Tensor, Tensor)",
    "npu_swiglu(Tensor self, int dim=-1) -> Tensor",
    "npu_swiglu_backward(Tensor grad_output, Tensor self, int dim=-1) -> Tensor",
]


@pytest.mark.parametrize("schema", CONTRACT_SCHEMAS)
def test_schemas_are_exact(npu_ops, schema):
    name = schema.split("(", 1)[0]
    assert getattr(npu, name).default._schema == torch._C.parse_schema("npu::" + schema)


def test_status_says_simulated(npu_ops):
    assert npu_ops.simulated and npu_ops.kind == "simulated"
