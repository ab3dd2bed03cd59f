"""The simulated ``npu_rotary_mul`` / ``npu_rotary_mul_backward`` against plain HF rotary math."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from qwen_npu_compile.ops.torch_npu import rotary_mul
from tests.helpers.graphs import aot_traced
from tests.helpers.graphs import call_targets as targets
from tests.helpers.tensors import meta, rotate_half

pytestmark = pytest.mark.usefixtures("simulated_npu_ops")


def hf_rotary(x, cos, sin):
    return x * cos + rotate_half(x) * sin


def rotary(x, cos, sin):
    return torch.ops.npu.npu_rotary_mul.default(x, cos, sin)


# (x shape, r shape): BSND with 1S1D / BS1D / BSND, BNSD with 11SD / B1SD, SBND with S11D, 3-D.
SHAPES = [
    pytest.param((2, 5, 3, 64), (1, 5, 1, 64), id="BSND-1S1D-d64"),
    pytest.param((2, 5, 3, 128), (2, 5, 1, 128), id="BSND-BS1D-d128"),
    pytest.param((2, 5, 3, 64), (2, 5, 3, 64), id="BSND-BSND-d64"),
    pytest.param((2, 3, 5, 128), (1, 1, 5, 128), id="BNSD-11SD-d128"),
    pytest.param((2, 3, 5, 64), (2, 1, 5, 64), id="BNSD-B1SD-d64"),
    pytest.param((5, 2, 3, 64), (5, 1, 1, 64), id="SBND-S11D-d64"),
    pytest.param((5, 3, 64), (5, 1, 64), id="3D-d64"),
]
DTYPES = [
    pytest.param(torch.float32, 1e-5, 1e-5, id="fp32"),
    pytest.param(torch.bfloat16, 2e-2, 2e-2, id="bf16"),
]


def _inputs(x_shape, r_shape, dtype, requires_grad=True):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(x_shape, generator=g).to(dtype)
    angle = torch.randn(r_shape, generator=g)
    cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    return [t.requires_grad_(requires_grad) for t in (x, cos, sin)]


@pytest.mark.parametrize("x_shape,r_shape", SHAPES)
@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
def test_forward_matches_hf(x_shape, r_shape, dtype, atol, rtol):
    x, cos, sin = _inputs(x_shape, r_shape, dtype, requires_grad=False)
    out = rotary(x, cos, sin)
    assert out.dtype == dtype and out.shape == x.shape
    expected = hf_rotary(x.float(), cos.float(), sin.float())
    torch.testing.assert_close(out.float(), expected, atol=atol, rtol=rtol)
    # and against HF computed in the input dtype (HF rounds after each op: about 1 ulp apart)
    torch.testing.assert_close(out, hf_rotary(x, cos, sin), atol=atol * 2, rtol=rtol * 2)


@pytest.mark.parametrize("x_shape,r_shape", SHAPES)
@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
def test_backward_matches_autograd_of_plain_math(x_shape, r_shape, dtype, atol, rtol):
    x, cos, sin = _inputs(x_shape, r_shape, dtype)
    out = rotary(x, cos, sin)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    got = torch.autograd.grad(out, (x, cos, sin), grad)

    ref_inputs = [t.detach().float().requires_grad_() for t in (x, cos, sin)]
    ref_out = hf_rotary(*ref_inputs)
    expected = torch.autograd.grad(ref_out, ref_inputs, grad.float())
    for name, g, e, t in zip(("dx", "dcos", "dsin"), got, expected, (x, cos, sin)):
        assert g.shape == t.shape and g.dtype == t.dtype, name
        # dcos/dsin are sums over the broadcast dims: scale the tolerance with the summed count
        n = x.numel() // t.numel()
        torch.testing.assert_close(g.float(), e, atol=atol * n, rtol=rtol, msg=lambda m: f"{name}: {m}")


def test_backward_op_outputs_directly():
    x, cos, sin = _inputs((2, 5, 3, 64), (1, 5, 1, 64), torch.bfloat16, requires_grad=False)
    grad = torch.randn_like(x)
    dx, dr1, dr2 = torch.ops.npu.npu_rotary_mul_backward.default(grad, x, cos, sin)
    assert (dx.shape, dx.dtype) == (x.shape, x.dtype)
    assert (dr1.shape, dr1.dtype) == (cos.shape, cos.dtype)
    assert (dr2.shape, dr2.dtype) == (sin.shape, sin.dtype)
    # dx = grad*r1 + rotate_half^T(grad*r2), rotate_half^T(y) = cat(y2, -y1)
    g, xf, c, s = grad.float(), x.float(), cos.float(), sin.float()
    y1, y2 = (g * s).chunk(2, -1)
    torch.testing.assert_close(dx.float(), g * c + torch.cat([y2, -y1], -1), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(dr1.float(), (g * xf).sum((0, 2), keepdim=True), atol=1e-1, rtol=2e-2)
    torch.testing.assert_close(dr2.float(), (g * rotate_half(xf)).sum((0, 2), keepdim=True), atol=1e-1, rtol=2e-2)


def test_only_x_requires_grad():
    x, cos, sin = _inputs((1, 4, 2, 64), (1, 4, 1, 64), torch.float32, requires_grad=False)
    x.requires_grad_()
    (dx,) = torch.autograd.grad(rotary(x, cos, sin).sum(), (x,))
    xr = x.detach().requires_grad_()
    (ex,) = torch.autograd.grad(hf_rotary(xr, cos, sin).sum(), (xr,))
    torch.testing.assert_close(dx, ex)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(rotary_mode="interleave"), "interleave"),
        (dict(rotary_mode="quarter"), "quarter"),
        (dict(rotate=torch.eye(64)), "rotate"),
    ],
)
def test_unsupported_mode_and_rotate_raise(kwargs, match):
    x, cos, sin = _inputs((1, 4, 2, 64), (1, 4, 1, 64), torch.float32, requires_grad=False)
    with pytest.raises(RuntimeError, match=match):
        torch.ops.npu.npu_rotary_mul.default(x, cos, sin, **kwargs)


def test_backward_op_refuses_other_modes():
    x, cos, sin = _inputs((1, 4, 2, 64), (1, 4, 1, 64), torch.float32, requires_grad=False)
    with pytest.raises(RuntimeError, match="interleave"):
        torch.ops.npu.npu_rotary_mul_backward.default(x, x, cos, sin, "interleave")


@pytest.mark.parametrize(
    "x_shape,r1_shape,r2_shape,dtypes,match",
    [
        ((4, 64), (4, 64), (4, 64), None, "3-D or 4-D"),
        ((1, 4, 2, 63), (1, 4, 1, 63), (1, 4, 1, 63), None, "even"),
        ((1, 4, 2, 896), (1, 4, 1, 896), (1, 4, 1, 896), None, "896"),
        ((1, 4, 2, 64), (1, 4, 1, 64), (1, 4, 2, 64), None, "r2 shape"),
        ((1, 4, 2, 64), (4, 1, 64), (4, 1, 64), None, "rank"),
        ((1, 4, 2, 64), (1, 3, 1, 64), (1, 3, 1, 64), None, "broadcast"),
        ((1, 4, 2, 64), (1, 4, 1, 32), (1, 4, 1, 32), None, "last dim"),
        ((1, 4, 2, 64), (1, 4, 1, 64), (1, 4, 1, 64), (torch.bfloat16, torch.float32), "dtype"),
        ((1, 4, 2, 64), (1, 4, 1, 64), (1, 4, 1, 64), (torch.float64, torch.float64), "dtype"),
    ],
)
def test_invalid_inputs_raise_in_kernel_and_fake(x_shape, r1_shape, r2_shape, dtypes, match):
    x_dtype, r_dtype = dtypes or (torch.float32, torch.float32)
    x = torch.randn(x_shape, dtype=x_dtype)
    r1, r2 = torch.randn(r1_shape, dtype=r_dtype), torch.randn(r2_shape, dtype=r_dtype)
    with pytest.raises(RuntimeError, match=match):
        rotary(x, r1, r2)
    with FakeTensorMode() as mode, pytest.raises(RuntimeError, match=match):
        rotary(mode.from_tensor(x), mode.from_tensor(r1), mode.from_tensor(r2))


def test_fake_tensor_shapes_and_dtypes():
    with FakeTensorMode():
        x = torch.empty(2, 7, 4, 128, dtype=torch.bfloat16)
        cos = torch.empty(2, 7, 1, 128, dtype=torch.bfloat16)
        out = rotary(x, cos, cos)
        assert (out.shape, out.dtype) == (x.shape, x.dtype)
        dx, dr1, dr2 = torch.ops.npu.npu_rotary_mul_backward.default(out, x, cos, cos)
        assert (dx.shape, dx.dtype) == (x.shape, x.dtype)
        assert (dr1.shape, dr1.dtype) == (cos.shape, cos.dtype)
        assert (dr2.shape, dr2.dtype) == (cos.shape, cos.dtype)


def test_opcheck():
    x, cos, sin = _inputs((2, 5, 3, 64), (1, 5, 1, 64), torch.float32)
    torch.library.opcheck(torch.ops.npu.npu_rotary_mul.default, (x, cos, sin))
    grad = torch.randn(x.shape)
    torch.library.opcheck(
        torch.ops.npu.npu_rotary_mul_backward.default, (grad, x.detach(), cos.detach(), sin.detach())
    )


def test_aot_backward_graph_contains_backward_op():
    def fn(x, cos, sin):
        return rotary(x, cos, sin) * 2

    x, cos, sin = _inputs((2, 5, 3, 64), (1, 5, 1, 64), torch.float32)
    compiled, graphs = aot_traced(fn)
    out = compiled(x, cos, sin)
    grads = torch.autograd.grad(out.sum(), (x, cos, sin))

    assert torch.ops.npu.npu_rotary_mul.default in targets(graphs["fw"])
    assert targets(graphs["bw"]).count(torch.ops.npu.npu_rotary_mul_backward.default) == 1
    expected = torch.autograd.grad(fn(x, cos, sin).sum(), (x, cos, sin))
    for g, e in zip(grads, expected):
        torch.testing.assert_close(g, e)


def _violation(x_shape, r_shape, dtype, layout, **kwargs):
    return rotary_mul.rotary_mul_violation(meta(*x_shape, dtype=dtype), meta(*r_shape, dtype=dtype),
                                           meta(*r_shape, dtype=dtype), layout=layout, **kwargs)


def test_limit_helper():
    """rotary_mul_violation: the kernel's layout-dependent limits (the one home of the op's limits)."""
    assert rotary_mul.MAX_HEAD_DIM == 896
    # ms-swift #9329: HF's head-first layout at decode (S=1), D=128 bf16 (256 bytes, 32-byte aligned)
    assert "561002" in _violation((1, 28, 1, 128), (1, 1, 1, 128), torch.bfloat16, "BNSD")
    assert _violation((1, 1, 28, 128), (1, 1, 1, 128), torch.bfloat16, "BSND") is None
    assert _violation((1, 28, 8, 128), (1, 1, 8, 128), torch.bfloat16, "BNSD") is None
    assert "896" in _violation((1, 4, 2, 896), (1, 4, 1, 896), torch.float16, "BSND")
    assert "even" in _violation((1, 4, 2, 63), (1, 4, 1, 63), torch.float16, "BSND")
    assert "1000" in _violation((1000, 2, 1, 64), (1, 2, 1, 64), torch.float16, "BSND")
    assert _violation((64, 2048, 32, 64), (64, 2048, 1, 64), torch.float16, "BSND", r_requires_grad=False) is None
    assert "1024" in _violation((64, 2048, 32, 64), (64, 2048, 1, 64), torch.float16, "BSND", r_requires_grad=True)
    assert "dtype" in _violation((1, 4, 2, 64), (1, 4, 1, 64), torch.float64, "BSND")
    with pytest.raises(ValueError):
        _violation((1, 4, 2, 64), (1, 4, 1, 64), torch.float16, "NBSD")


@pytest.mark.parametrize("x_shape,r_shape,expected", [
    pytest.param((2, 16, 4, 64), (1, 16, 1, 64), None, id="d64-bn8"),
    pytest.param((2, 16, 4, 128), (1, 16, 1, 128), None, id="d128"),
    pytest.param((2, 16, 4, 16), (1, 16, 1, 16), "D % 64 == 0, got D=16", id="d16"),
    pytest.param((2, 16, 4, 96), (1, 16, 1, 96), "D % 64 == 0, got D=96", id="d96"),
    pytest.param((64, 16, 32, 64), (1, 16, 1, 64), "multiply to <= 1024, got 2048", id="broadcast-2048"),
    pytest.param((64, 16, 32, 64), (64, 16, 1, 64), None, id="broadcast-32"),
])
def test_torchair_backward_converter_limits(x_shape, r_shape, expected):
    """torch_npu 2.13.0 torchair converter npu_rotary_mul_backward (A2/A3): only with backward and torchair."""
    assert _violation(x_shape, r_shape, torch.bfloat16, "BSND") is None  # the kernel takes them all
    reason = _violation(x_shape, r_shape, torch.bfloat16, "BSND", backward=True, downstream="torchair")
    if expected is None:
        assert reason is None
    else:
        assert expected in reason and "npu_rotary_mul_backward" in reason, reason
    assert _violation(x_shape, r_shape, torch.bfloat16, "BSND", backward=True, downstream="aot_eager") is None


def test_torchair_backward_converter_refuses_symbolic_sizes():
    """The converter raises on any dynamic size (S under dynamic=True), decided without a guard."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    shape_env = ShapeEnv()
    mode = FakeTensorMode(shape_env=shape_env)
    context = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.STATIC, DimDynamic.DYNAMIC, DimDynamic.STATIC,
                                                      DimDynamic.STATIC])
    x = mode.from_tensor(torch.empty(2, 16, 4, 64), symbolic_context=context)
    with mode:
        r = torch.empty(1, x.shape[1], 1, 64)
    reason = rotary_mul.rotary_mul_violation(x, r, r, layout="BSND", backward=True, downstream="torchair")
    assert "needs static shapes" in reason
    assert x.shape[1].node.expr not in shape_env.replacements, "S was specialised"
