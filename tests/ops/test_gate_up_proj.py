"""``qwen_npu::gate_up_proj`` (gate_proj and up_proj into the halves of one buffer) against plain
``x @ w.T`` and its autograd: values, gradients, fake/meta shapes, symbolic sizes, AOTAutograd, errors,
and ``npu_swiglu(buf, 0)`` on its output equal to ``silu(gate) * up``."""

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from qwen_npu_compile.ops.limits import node_violation
from qwen_npu_compile.ops.qwen_npu import gate_up_proj
from tests.helpers.graphs import aot_traced, call_targets

OP = gate_up_proj.OP
aten = torch.ops.aten
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _inputs(shape, inter, dtype, requires_grad=False):
    x = torch.randn(*shape, dtype=dtype)
    w_gate = torch.randn(inter, shape[-1], dtype=dtype) / shape[-1] ** 0.5
    w_up = torch.randn(inter, shape[-1], dtype=dtype) / shape[-1] ** 0.5
    return [t.requires_grad_(requires_grad) for t in (x, w_gate, w_up)]


@pytest.mark.parametrize("shape,inter", [((2, 8, 64), 128), ((1, 1, 896), 4864), ((5, 16), 24), ((16,), 8)])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
def test_halves_are_the_two_linears(shape, inter, dtype):
    x, w_gate, w_up = _inputs(shape, inter, dtype)
    out = OP(x, w_gate, w_up)
    assert out.shape == (2, *shape[:-1], inter) and out.dtype == dtype and out.is_contiguous()
    # each half is computed by the same matmul as F.linear without bias: bit-identical
    torch.testing.assert_close(out[0], F.linear(x, w_gate), atol=0, rtol=0)
    torch.testing.assert_close(out[1], F.linear(x, w_up), atol=0, rtol=0)


def test_non_contiguous_input_is_read_correctly():
    x, w_gate, w_up = _inputs((8, 2, 32), 16, torch.float32)
    xt = x.transpose(0, 1)  # [2, 8, 32], not contiguous
    out = OP(xt, w_gate, w_up)
    torch.testing.assert_close(out, torch.stack([xt @ w_gate.T, xt @ w_up.T]))


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
def test_backward_matches_autograd_of_the_reference(dtype):
    x, w_gate, w_up = _inputs((2, 8, 32), 48, dtype, requires_grad=True)
    grad = torch.randn(2, 2, 8, 48, dtype=dtype)
    got = torch.autograd.grad(OP(x, w_gate, w_up), (x, w_gate, w_up), grad)
    reference = torch.stack([F.linear(x, w_gate), F.linear(x, w_up)])
    want = torch.autograd.grad(reference, (x, w_gate, w_up), grad)
    for a, b in zip(got, want):
        assert a.dtype == dtype and a.shape == b.shape
        if dtype == torch.float32:
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        else:  # both round per matmul; the order of the dx accumulation may differ by an ulp
            torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)


def test_frozen_weights_get_no_gradient():
    x, w_gate, w_up = _inputs((3, 16), 8, torch.float32)
    x.requires_grad_(True)
    (dx,) = torch.autograd.grad(OP(x, w_gate, w_up).sum(), (x,))
    torch.testing.assert_close(dx, (w_gate.sum(0) + w_up.sum(0)).expand(3, 16))
    assert w_gate.grad is None and w_up.grad is None


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
def test_npu_swiglu_along_dim_0_of_the_buffer_is_silu_gate_times_up(simulated_npu_ops, dtype):
    x, w_gate, w_up = _inputs((2, 4, 32), 64, dtype, requires_grad=True)
    fused = torch.ops.npu.npu_swiglu.default(OP(x, w_gate, w_up), 0).squeeze(0)
    gate, up = F.linear(x, w_gate), F.linear(x, w_up)
    reference = (F.silu(gate.float()) * up.float()).to(dtype)  # the kernel computes in fp32, rounds once
    torch.testing.assert_close(fused, reference, atol=0, rtol=0)
    grad = torch.randn_like(fused)
    got = torch.autograd.grad(fused, (x, w_gate, w_up), grad)
    want = torch.autograd.grad(F.silu(gate) * up, (x, w_gate, w_up), grad)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for a, b in zip(got, want):
        torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol)


def test_fake_and_meta_shapes():
    with FakeTensorMode():
        out = OP(torch.empty(2, 7, 64, dtype=torch.bfloat16), torch.empty(96, 64, dtype=torch.bfloat16),
                 torch.empty(96, 64, dtype=torch.bfloat16))
    assert (out.shape, out.dtype) == ((2, 2, 7, 96), torch.bfloat16) and out.is_contiguous()
    meta = OP(*(t.to("meta") for t in _inputs((3, 16), 8, torch.float16)))
    assert (meta.shape, meta.dtype, meta.device.type) == ((2, 3, 8), torch.float16, "meta")


def test_symbolic_token_dims_trace_without_guards_and_backward_is_aten_mm():
    x, w_gate, w_up = _inputs((2, 5, 16), 24, torch.float32, requires_grad=True)

    def step(x, w_gate, w_up):
        out = OP(x, w_gate, w_up)
        return torch.autograd.grad(out, (x, w_gate, w_up), torch.ones_like(out))

    gm = make_fx(step, tracing_mode="symbolic")(x, w_gate, w_up)
    [node] = gm.graph.find_nodes(op="call_function", target=OP)
    batch, seq, inter = node.meta["val"].shape[1:]
    assert isinstance(batch, torch.SymInt) and isinstance(seq, torch.SymInt)
    targets = call_targets(gm)
    assert targets.count(aten.mm.default) == 4 and aten.cat.default not in targets
    assert [g.expr for g in node.meta["val"].fake_mode.shape_env.guards] == []
    torch.testing.assert_close(gm(x, w_gate, w_up)[0], step(x, w_gate, w_up)[0])


def test_aot_autograd_keeps_the_op_forward_and_differentiates_with_mm():
    x, w_gate, w_up = _inputs((2, 6, 16), 24, torch.bfloat16, requires_grad=True)
    compiled, graphs = aot_traced(lambda x, wg, wu: OP(x, wg, wu) * 2)
    out = compiled(x, w_gate, w_up)
    out.sum().backward()
    assert call_targets(graphs["fw"]).count(OP) == 1
    backward = call_targets(graphs["bw"])
    assert OP not in backward and backward.count(aten.mm.default) == 4 and aten.cat.default not in backward
    torch.testing.assert_close(out, OP(x, w_gate, w_up) * 2)


@pytest.mark.parametrize("args,message", [
    (((2, 8), (16, 8), (12, 8), torch.float32), r"differ \(I or H\)"),
    (((2, 8), (16, 4), (16, 4), torch.float32), "last dim 8 != the weights' H 4"),
    (((2, 8), (16, 8, 1), (16, 8, 1), torch.float32), "must be 2-D"),
    (((1, 1, 1, 1, 2, 8), (16, 8), (16, 8), torch.float32), "1 to 5 dims, got 6"),
    (((2, 8), (16, 8), (16, 8), torch.float64), "unsupported dtype torch.float64"),
])
def test_bad_inputs_raise_naming_the_limit(args, message):
    x_shape, gate_shape, up_shape, dtype = args
    with pytest.raises(RuntimeError, match=message):
        OP(torch.randn(x_shape, dtype=dtype), torch.randn(gate_shape, dtype=dtype), torch.randn(up_shape, dtype=dtype))
    with FakeTensorMode(), pytest.raises(RuntimeError, match=message):
        OP(torch.empty(x_shape, dtype=dtype), torch.empty(gate_shape, dtype=dtype), torch.empty(up_shape, dtype=dtype))


def test_mixed_dtypes_raise_asking_for_one_dtype():
    with pytest.raises(RuntimeError, match="dtypes differ .* cast them to one dtype"):
        OP(torch.randn(2, 8, dtype=torch.bfloat16), torch.randn(16, 8), torch.randn(16, 8))


def test_limits_by_graph_node():
    def emitted(x, w_gate, w_up):
        return OP(x, w_gate, w_up)

    good = make_fx(emitted, tracing_mode="fake")(*_inputs((2, 8), 16, torch.bfloat16))
    [node] = good.graph.find_nodes(op="call_function", target=OP)
    assert node_violation(node) is None
    node.args[1].meta["val"] = node.args[1].meta["val"].to(torch.float32)
    assert "dtypes differ" in node_violation(node)
