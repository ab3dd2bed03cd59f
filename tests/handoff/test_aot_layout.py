"""The AOT graphs' layout audit (qwen_npu_compile.handoff.aot_layout): torch's fake kernels that promise another
layout than the eager kernel are found at compile time and their output pinned to the traced layout.

The torch bug behind the Qwen3.5 / Qwen3-Next training crash: ``aten.softplus_backward``'s
meta kernel follows ``self``'s layout, the CPU kernel ``grad_output``'s; AOTAutograd then emits an
``aten.view`` the eager backward cannot run.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from qwen_npu_compile.handoff import aot_layout
from qwen_npu_compile.report import SUMMARY

#: the torch bug and the audit are version-dependent: every stack of the matrix runs this file (~10 s)
pytestmark = pytest.mark.stack_compat

aten = torch.ops.aten


def _softplus_backward_differs() -> bool:
    """Whether this torch's meta kernel of softplus_backward disagrees with the CPU kernel (the bug)."""
    g, x = torch.randn(2, 4, 16).transpose(1, 2), torch.randn(2, 16, 4)
    return aten.softplus_backward(g, x, 1, 20).stride() != aten.softplus_backward(g.to("meta"), x.to("meta"), 1, 20).stride()


BUG = _softplus_backward_differs()


def _fake_graph(fn, *inputs):
    """``fn`` traced by make_fx with FakeTensor ``meta["val"]`` (as AOTAutograd hands graphs over)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    mode = FakeTensorMode()
    return make_fx(fn, tracing_mode="fake")(*inputs), mode


@pytest.mark.parametrize("op,args", [
    (aten.softplus_backward.default, (1, 20)),
    (aten.hardswish_backward.default, ()),
    (aten.sigmoid_backward.default, ()),
    (aten.mul.Tensor, ()),
])
def test_audit_agrees_with_the_kernels(op, args):
    """The audit's verdict is the kernels' truth on this torch: a mismatch exactly where the CPU kernel's
    and the meta kernel's strides differ (so the test follows torch when it fixes the bug)."""
    g, x = torch.randn(2, 4, 16).transpose(1, 2), torch.randn(2, 16, 4)
    differs = op(g, x, *args).stride() != op(g.to("meta"), x.to("meta"), *args).stride()
    gm = torch.fx.experimental.proxy_tensor.make_fx(lambda a, b: op(a, b, *args), tracing_mode="fake")(g, x)
    node = next(n for n in gm.graph.nodes if n.target == op)
    found = aot_layout.eager_layout_mismatch(node)
    assert (found is not None) == differs
    if differs:
        assert found == ((0, 1, 2), (0, 2, 1))  # fake: row-major; eager: the transposed gradient's


def test_same_layouts_are_not_probed():
    gm = torch.fx.experimental.proxy_tensor.make_fx(lambda a, b: aten.softplus_backward(a, b, 1, 20),
                                                     tracing_mode="fake")(torch.randn(2, 16, 4), torch.randn(2, 16, 4))
    node = next(n for n in gm.graph.nodes if n.target == aten.softplus_backward.default)
    assert not aot_layout._candidate(node)
    assert aot_layout.pin_layouts(gm) == []


@pytest.mark.skipif(not BUG, reason="this torch's softplus_backward meta kernel agrees with the CPU kernel")
@pytest.mark.parametrize("contiguous_fake", [True, False])
def test_pinned_graph_has_the_traced_layout(contiguous_fake):
    """After the pin, the graph's output has the fake value's strides on real inputs, in both pin forms
    (clone to row-major; permute / clone / permute for a non-row-major traced layout)."""
    if contiguous_fake:
        g, x = torch.randn(2, 4, 16).transpose(1, 2), torch.randn(2, 16, 4)
    else:  # fake follows x (dims 0, 2, 1), eager follows the row-major gradient
        g, x = torch.randn(2, 16, 4), torch.randn(2, 4, 16).transpose(1, 2)
    gm = torch.fx.experimental.proxy_tensor.make_fx(lambda a, b: aten.softplus_backward(a, b, 1, 20).view(2, 64) if contiguous_fake
                                                     else aten.softplus_backward(a, b, 1, 20), tracing_mode="fake")(g, x)
    fake = next(n for n in gm.graph.nodes if n.target == aten.softplus_backward.default).meta["val"]
    if contiguous_fake:
        with pytest.raises(RuntimeError, match="view size is not compatible"):
            gm(g, x)  # the torch bug itself
    pins = aot_layout.pin_layouts(gm)
    assert [pin["op"] for pin in pins] == ["aten.softplus_backward.default"]
    out = gm(g, x)
    want = aten.softplus_backward(g, x, 1, 20)
    if contiguous_fake:
        torch.testing.assert_close(out, want.reshape(2, 64))
    else:
        assert out.stride() == fake.stride()
        torch.testing.assert_close(out, want)


class _GateBlock(torch.nn.Module):
    """The Gated DeltaNet's gate, as transformers 5.24 ``Qwen3_5GatedDeltaNet`` computes and reads it:
    ``g = -A_log.exp() * softplus(in_proj_a(h).float() + dt_bias)``, then ``g.transpose(1, 2)``."""

    def __init__(self, hidden=32, heads=4):
        super().__init__()
        self.in_proj_a = torch.nn.Linear(hidden, heads, bias=False)
        self.A_log = torch.nn.Parameter(torch.randn(heads))
        self.dt_bias = torch.nn.Parameter(torch.randn(heads))

    def forward(self, h):
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(h).float() + self.dt_bias)
        return g.transpose(1, 2).contiguous().cumsum(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gate_block_trains_compiled(dtype):
    """The crash's minimal model: eager trains; compiled with qwen_npu it trains too, with the same
    gradients, and the report names the one pinned node of the backward graph."""
    torch.manual_seed(0)
    block = _GateBlock().to(dtype)
    h = torch.randn(2, 16, 32, dtype=dtype)
    eager = block(h)
    eager.float().square().sum().backward()
    want = [p.grad.clone() for p in block.parameters()]
    block.zero_grad()
    compiled = torch.compile(block, backend="qwen_npu")
    out = compiled(h)
    out.float().square().sum().backward()
    tol = dict(rtol=0, atol=0) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out, eager, **tol)
    for p, w in zip(block.parameters(), want):
        torch.testing.assert_close(p.grad, w, **tol)
    (report,) = SUMMARY.graphs
    assert [(p["graph"], p["op"]) for p in report.layout_pins] == ([("backward", "aten.softplus_backward.default")] if BUG else [])
    assert report.as_dict()["layout_pins"] == report.layout_pins


def test_dynamic_sequence_length_is_audited_without_a_guard(npu_ops):
    """Under dynamic shapes the audit reads the sizes' hints, never ``int(symint)``: one graph serves every
    sequence length (a guard would recompile per length), and the pin is there in that graph."""
    torch.manual_seed(0)
    block = _GateBlock()
    compiled = torch.compile(block, backend="qwen_npu", dynamic=True)
    for seq in (16, 23, 40):
        h = torch.randn(2, seq, 32)
        out = compiled(h)
        out.square().sum().backward()
        torch.testing.assert_close(out, block(h), rtol=0, atol=0)
    (report,) = SUMMARY.graphs
    assert len(report.layout_pins) == (1 if BUG else 0)
