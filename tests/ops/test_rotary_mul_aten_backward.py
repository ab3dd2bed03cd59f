"""``qwen_npu::rotary_mul_aten_backward``: the fused forward, HF's input gradient in ATen ops."""

from __future__ import annotations

import pytest
import torch

from qwen_npu_compile.ops.qwen_npu import rotary_mul_aten_backward
from tests.helpers.graphs import aot_traced
from tests.helpers.graphs import call_targets as targets
from tests.helpers.tensors import rotate_half

OP = rotary_mul_aten_backward.OP


def _inputs(x_shape, r_shape, dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(x_shape, generator=g).to(dtype).requires_grad_()
    angle = torch.randn(r_shape, generator=g)  # halves not equal: the general case
    return x, angle.cos().to(dtype), angle.sin().to(dtype)


@pytest.mark.parametrize("x_shape,r_shape", [
    pytest.param((2, 7, 4, 64), (1, 7, 1, 64), id="BSND-1S1D-d64"),
    pytest.param((2, 7, 4, 128), (2, 7, 1, 128), id="BSND-BS1D-d128"),
    pytest.param((2, 4, 7, 16), (1, 1, 7, 16), id="BNSD-11SD-d16"),
])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"])
def test_forward_and_input_gradient_match_hf(npu_ops, x_shape, r_shape, dtype, tol):
    x, cos, sin = _inputs(x_shape, r_shape, dtype)
    out = OP(x, cos, sin)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    (dx,) = torch.autograd.grad(out, x, grad)
    ref_x = x.detach().float().requires_grad_()
    ref = ref_x * cos.float() + rotate_half(ref_x) * sin.float()
    (ref_dx,) = torch.autograd.grad(ref, ref_x, grad.float())
    assert (out.dtype, dx.dtype, dx.shape) == (dtype, dtype, x.shape)
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
    torch.testing.assert_close(dx.float(), ref_dx, atol=tol, rtol=tol)


def test_backward_graph_is_plain_aten(npu_ops):
    """AOTAutograd's backward holds no fused rotary op (what torchair's RotaryMulGrad converter refuses)."""
    x, cos, sin = _inputs((2, 5, 3, 64), (1, 5, 1, 64), torch.float32)
    compiled, graphs = aot_traced(lambda x, cos, sin: OP(x, cos, sin) * 2)
    (dx,) = torch.autograd.grad(compiled(x, cos, sin).sum(), x)
    assert targets(graphs["fw"]).count(OP) == 1
    backward = targets(graphs["bw"])
    assert all(t.namespace == "aten" for t in backward if isinstance(t, torch._ops.OpOverload)), backward
    assert torch.ops.aten.cat.default in backward
    ref_x = x.detach().requires_grad_()
    (ref_dx,) = torch.autograd.grad(((ref_x * cos + rotate_half(ref_x) * sin) * 2).sum(), ref_x)
    torch.testing.assert_close(dx, ref_dx)


def test_opcheck(npu_ops):
    x, cos, sin = _inputs((2, 5, 3, 64), (1, 5, 1, 64), torch.float32)
    torch.library.opcheck(OP, (x, cos, sin))


def test_cos_sin_that_need_grad_are_refused(npu_ops):
    x, cos, sin = _inputs((1, 4, 2, 16), (1, 4, 1, 16), torch.float32)
    out = OP(x, cos.requires_grad_(), sin)
    with pytest.raises(RuntimeError, match="need grad"):
        out.sum().backward()
