"""``npu_grouped_matmul`` stand-in and ``qwen_npu::grouped_matmul`` (the MoE experts' matmuls): values and gradients against
``aten._grouped_mm``, the wheel's schema and meta kernel, the limits."""

from __future__ import annotations

import pytest
import torch

from qwen_npu_compile.ops.qwen_npu import grouped_matmul as gmm
from qwen_npu_compile.ops.torch_npu import grouped_matmul as npu_gmm
from tests.helpers.graphs import aot_traced, call_targets
from tests.helpers.torchair import torchair_wheel_sources

npu = torch.ops.npu


def _case(dtype, sizes=(3, 0, 5, 4), k=16, n=24):
    """x [M, K] grouped by ``sizes`` (one empty group), weight [E, K, N] as a transposed view (as HF passes
    ``gate_up_proj.transpose(-2, -1)``), int32 offsets (aten) and int64 (ours)."""
    g = torch.Generator().manual_seed(0)
    m = sum(sizes)
    x = torch.randn(m, k, generator=g).to(dtype)
    weight = torch.randn(len(sizes), n, k, generator=g).to(dtype).transpose(1, 2)
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    return x, weight, offs


def _loop(x, weight, ends):
    out, start = [], 0
    for e, end in enumerate(ends.tolist()):
        out.append(x[start:end].float() @ weight[e].float())
        start = end
    return torch.cat(out)


@pytest.mark.parametrize("group_list_type", [0, 1])
def test_stand_in_group_type_0_is_a_loop_of_matmuls(simulated_npu_ops, group_list_type):
    x, weight, offs = _case(torch.float32)
    group_list = offs.long() if group_list_type == 0 else torch.tensor([3, 0, 5, 4])
    (y,) = npu.npu_grouped_matmul.default([x], [weight], group_list=group_list, split_item=3, group_type=0,
                                          group_list_type=group_list_type)
    torch.testing.assert_close(y, _loop(x, weight, offs))


def test_stand_in_group_type_2_is_the_weight_gradient(simulated_npu_ops):
    x, _, offs = _case(torch.float32)
    g = torch.randn(x.shape[0], 24)
    (dw,) = npu.npu_grouped_matmul.default([x.t()], [g], group_list=offs.long(), split_item=3, group_type=2,
                                           group_list_type=0)
    assert dw.shape == (4, 16, 24)
    assert torch.count_nonzero(dw[1]) == 0  # the empty group
    torch.testing.assert_close(dw[2], x[3:8].t() @ g[3:8])


def test_stand_in_refuses_int32_group_list_and_uncovered_rows(simulated_npu_ops):
    x, weight, offs = _case(torch.float32)
    with pytest.raises(RuntimeError, match="int64"):
        npu.npu_grouped_matmul.default([x], [weight], group_list=offs, split_item=3, group_type=0)
    with pytest.raises(RuntimeError, match="cover 11 rows"):
        npu.npu_grouped_matmul.default([x], [weight], group_list=torch.tensor([3, 3, 8, 11]), split_item=3,
                                       group_type=0, group_list_type=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_op_matches_aten_grouped_mm_forward_and_backward(npu_ops, dtype):
    x, weight, offs = _case(dtype)
    leaves = [t.detach().requires_grad_() for t in (x, weight)]
    ref_leaves = [t.detach().requires_grad_() for t in (x, weight)]
    out = gmm.OP(leaves[0], leaves[1].transpose(1, 2).transpose(1, 2), offs.long())
    ref = torch._grouped_mm(ref_leaves[0], ref_leaves[1], offs=offs)
    grad = torch.randn_like(ref)
    out.backward(grad)
    ref.backward(grad)
    tol = {} if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out, ref, **tol)
    for ours, theirs in zip(leaves, ref_leaves):
        torch.testing.assert_close(ours.grad, theirs.grad, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_transposed_weight_gets_its_gradient_in_the_parameters_layout(npu_ops, dtype):
    """transformers' experts pass ``gate_up_proj.transpose(1, 2)`` (a parameter [E, N, K]): dW is computed
    as dWᵀ in the parameter's layout (group_type=2 on gᵀ and x), so the parameter's .grad is contiguous (no
    layout copy after the graph) and equals aten._grouped_mm's."""
    x, weight, offs = _case(dtype)
    param = weight.detach().transpose(1, 2).contiguous().requires_grad_()  # [E, N, K], as transformers stores it
    ref_param, ref_x = param.detach().clone().requires_grad_(), x.detach().clone().requires_grad_()
    x = x.detach().requires_grad_()
    out = gmm.OP(x, param.transpose(1, 2), offs.long())
    ref = torch._grouped_mm(ref_x, ref_param.transpose(1, 2), offs=offs)
    grad = torch.randn_like(ref)
    out.backward(grad)
    ref.backward(grad)
    tol = {} if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    assert param.grad.is_contiguous() and param.grad.shape == param.shape
    torch.testing.assert_close(param.grad, ref_param.grad, **tol)
    torch.testing.assert_close(x.grad, ref_x.grad, **tol)


def test_aot_graphs_hold_the_op_forward_and_npu_grouped_matmul_backward(npu_ops):
    x, weight, offs = _case(torch.bfloat16)
    compiled, graphs = aot_traced(lambda a, w, o: gmm.OP(a, w, o))
    compiled(x.requires_grad_(), weight.detach().requires_grad_(), offs.long()).sum().backward()
    assert call_targets(graphs["fw"]).count(gmm.OP) == 1
    backward = [n for n in graphs["bw"].graph.nodes if n.target is npu.npu_grouped_matmul.default]
    assert sorted(n.kwargs["group_type"] for n in backward) == [0, 2]  # dx, dW
    assert torch.ops.aten._grouped_mm.default not in call_targets(graphs["bw"])


def test_limits_name_what_to_change(npu_ops):
    x, weight, offs = _case(torch.float32)
    violation = npu_gmm.grouped_matmul_violation
    assert violation(x, weight, offs.long()) is None
    assert "int64" in violation(x, weight, offs)
    assert "dtypes differ" in violation(x, weight.to(torch.bfloat16), offs.long())
    many = torch.empty(npu_gmm.MAX_GROUPS + 1, 16, 8)
    assert "at most 1024" in violation(x, many, torch.zeros(npu_gmm.MAX_GROUPS + 1, dtype=torch.int64))
    wide = torch.empty(1, npu_gmm.INNER_LIMIT, 8)
    assert "below 65536" in violation(torch.empty(2, npu_gmm.INNER_LIMIT), wide, torch.tensor([2]))
    long_rows = torch.empty(npu_gmm.INNER_LIMIT, 16)
    assert violation(long_rows, weight, offs.long()) is None
    assert "weight gradient" in violation(long_rows, weight, offs.long(), backward=True)
    with pytest.raises(RuntimeError, match="qwen_npu::grouped_matmul: .*int64"):
        gmm.OP(x, weight, offs)


# the stand-in against the torch_npu wheel (schema, meta kernel); skipped without the cached wheel


@pytest.fixture(scope="module")
def sources():
    return torchair_wheel_sources()


def test_stand_in_schema_and_meta_equal_the_wheels(simulated_npu_ops, sources):
    from torch._subclasses.fake_tensor import FakeTensorMode

    from tests.helpers.wheel_contracts import describe, load_meta_kernels, schema_mismatches

    assert schema_mismatches(sources.schemas_yaml, ["npu_grouped_matmul"]) == {}
    meta = load_meta_kernels(sources.meta_registrations).functions["npu_grouped_matmul"]
    x, weight, offs = _case(torch.bfloat16)
    g, offs = torch.randn(x.shape[0], 24, dtype=torch.bfloat16), offs.long()
    for a, b, group_type in (([x], [weight], 0), ([x.t()], [g], 2)):  # forward/dx, dW
        kwargs = dict(split_item=3, group_type=group_type, group_list_type=0)
        theirs = describe(meta([t.to("meta") for t in a], [t.to("meta") for t in b], group_list=offs.to("meta"),
                               **kwargs))
        with FakeTensorMode() as mode:
            ours = describe(npu.npu_grouped_matmul.default([mode.from_tensor(t) for t in a],
                                                           [mode.from_tensor(t) for t in b],
                                                           group_list=mode.from_tensor(offs), **kwargs))
        assert ours == theirs
    assert theirs == ("torch.bfloat16[4, 16, 24]",)
