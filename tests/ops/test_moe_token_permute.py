"""``npu_moe_token_permute`` / ``npu_moe_token_unpermute`` stand-ins (the ops of verl's npu_patch MoE block):
values and gradients against a plain PyTorch reference, opcheck, the wheel's schemas and meta kernels."""

from __future__ import annotations

import pytest
import torch

from qwen_npu_compile.ops.torch_npu import moe_token_permute as mtp
from tests.helpers.graphs import aot_traced, call_targets
from tests.helpers.torchair import torchair_wheel_sources

npu = torch.ops.npu


def _case(dtype, tokens=5, hidden=8, experts=4, topk=2):
    """tokens [N, H], distinct top-k expert ids [N, K] (int64, as verl's topk gives), probs [N, K] (rows sum to 1)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(experts, generator=g)[:topk] for _ in range(tokens)])
    probs = torch.rand(tokens, topk, generator=g).softmax(-1).to(dtype)
    return x, ids, probs


def _reference_permute(x, ids):
    """Plain PyTorch: rows (token, k) sorted stably by expert id; ``where[i]`` = sorted position of flat row i."""
    flat = ids.reshape(-1)
    order = sorted(range(flat.numel()), key=lambda i: (int(flat[i]), i))
    k = 1 if ids.dim() == 1 else ids.shape[1]
    permuted = torch.stack([x[i // k] for i in order])
    where = torch.empty(flat.numel(), dtype=torch.int32)
    for pos, i in enumerate(order):
        where[i] = pos
    return permuted, where


def _reference_moe(x, ids, probs, weights):
    """The routed sum the two ops compute around per-expert work ``weights[e]`` (a matmul): per token,
    ``sum_k probs[t, k] * (x[t] @ weights[ids[t, k]])``, in fp32."""
    out = torch.zeros(x.shape[0], weights.shape[2])
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            out[t] += probs[t, k].float() * (x[t].float() @ weights[ids[t, k]].float())
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_permute_sorts_rows_by_expert(simulated_npu_ops, dtype, index_dtype):
    x, ids, _ = _case(dtype)
    permuted, sorted_indices = npu.npu_moe_token_permute.default(x, ids.to(index_dtype))
    expected, where = _reference_permute(x, ids)
    assert sorted_indices.dtype == torch.int32 and permuted.dtype == dtype
    torch.testing.assert_close(permuted, expected, rtol=0, atol=0)
    assert torch.equal(sorted_indices, where)
    # the documented relation: permuted_tokens[sorted_indices[i]] = tokens[i // topK]
    assert torch.equal(permuted[sorted_indices.long()], x.repeat_interleave(2, 0))


def test_permute_docs_example_and_num_out_tokens(simulated_npu_ops):
    """The wheel's _op_plugin_docs.py example (tokens [[1,1],[2,2],[3,3],[4,4]], indices [[0,1],[1,0],[0,2],[2,0]]);
    num_out_tokens keeps the first rows (meta kernel size rule), a 1-D index is topK 1."""
    tokens = torch.tensor([[1, 1], [2, 2], [3, 3], [4, 4]], dtype=torch.float16)
    indices = torch.tensor([[0, 1], [1, 0], [0, 2], [2, 0]])
    permuted, sorted_indices = npu.npu_moe_token_permute.default(tokens, indices)
    assert permuted[:, 0].tolist() == [1, 2, 3, 4, 1, 2, 3, 4]  # expert 0: tokens 0,1,2,3; 1: 0,1; 2: 2,3
    assert sorted_indices.tolist() == [0, 4, 5, 1, 2, 6, 7, 3]
    assert npu.npu_moe_token_permute.default(tokens, indices, 5)[0].shape == (5, 2)
    assert npu.npu_moe_token_permute.default(tokens, indices, -2)[0].shape == (6, 2)
    one, where = npu.npu_moe_token_permute.default(tokens, torch.tensor([2, 0, 1, 0]))
    assert one[:, 0].tolist() == [2, 4, 3, 1] and where.tolist() == [3, 0, 2, 1]


def test_unpermute_docs_example(simulated_npu_ops):
    """The wheel's docs example: sorted_indices [0,4,5,1,2,6,7,3], probs 1/2: each token's two rows averaged."""
    permuted = torch.tensor([[1, 1], [2, 2], [3, 3], [4, 4], [1, 1], [2, 2], [3, 3], [4, 4]], dtype=torch.float16)
    sorted_indices = torch.tensor([0, 4, 5, 1, 2, 6, 7, 3], dtype=torch.int32)
    out = npu.npu_moe_token_unpermute.default(permuted, sorted_indices, torch.full((4, 2), 0.5, dtype=torch.float16))
    assert out.dtype == torch.float16 and out[:, 0].tolist() == [1.0, 2.0, 3.0, 4.0]
    assert npu.npu_moe_token_unpermute.default(permuted, sorted_indices).shape == (8, 2)  # no probs: topK 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_permute_experts_unpermute_values_and_gradients(simulated_npu_ops, dtype):
    """permute -> per-expert matmul (sorted rows) -> unpermute(probs) equals the plain routed sum, and the
    gradients of tokens, probs and weights equal those of that plain PyTorch reference."""
    x, ids, probs = _case(dtype)
    weights = torch.randn(4, 8, 6, generator=torch.Generator().manual_seed(2)).to(dtype)
    leaves = [t.clone().requires_grad_() for t in (x, probs, weights)]
    ref_leaves = [t.detach().float().requires_grad_() for t in (x, probs, weights)]

    def ours(x, probs, weights):
        permuted, sorted_indices = npu.npu_moe_token_permute.default(x, ids)
        experts = ids.reshape(-1).sort(stable=True).values
        rows = torch.stack([permuted[j] @ weights[experts[j]] for j in range(permuted.shape[0])])
        return npu.npu_moe_token_unpermute.default(rows, sorted_indices, probs)

    out = ours(*leaves)
    ref = _reference_moe(*ref_leaves[:1], ids, ref_leaves[1], ref_leaves[2])
    tol = dict(rtol=0, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out.float(), ref, **tol)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    out.backward(grad.to(dtype))
    ref.backward(grad)
    for mine, theirs in zip(leaves, ref_leaves):
        torch.testing.assert_close(mine.grad.float(), theirs.grad, **tol)


def test_backward_ops_are_the_grad_v2_ops(simulated_npu_ops):
    """AOTAutograd's backward graph holds npu_moe_token_permute_grad_v2 / npu_moe_token_unpermute_grad_v2
    (torch_npu's derivatives), never a decomposition."""
    x, ids, probs = _case(torch.float32)

    def fn(x, ids, probs):
        permuted, sorted_indices = npu.npu_moe_token_permute.default(x, ids)
        return npu.npu_moe_token_unpermute.default(permuted * 2, sorted_indices, probs)

    compiled, graphs = aot_traced(fn)
    compiled(x.clone().requires_grad_(), ids, probs.clone().requires_grad_()).sum().backward()
    assert npu.npu_moe_token_permute.default in call_targets(graphs["fw"])
    assert npu.npu_moe_token_unpermute.default in call_targets(graphs["fw"])
    backward = call_targets(graphs["bw"])
    assert npu.npu_moe_token_permute_grad_v2.default in backward
    assert npu.npu_moe_token_unpermute_grad_v2.default in backward


def test_grad_ops_direct(simulated_npu_ops):
    """The two grad ops against their formulas (docs of MoeTokenPermuteGrad / MoeTokenUnpermuteGrad)."""
    g = torch.Generator().manual_seed(4)
    sorted_indices = torch.tensor([0, 4, 5, 1, 2, 6, 7, 3], dtype=torch.int32)
    grad_permuted = torch.randn(8, 3, generator=g)
    grad_tokens = npu.npu_moe_token_permute_grad_v2.default(grad_permuted, sorted_indices, 4, torch.bfloat16, 2)
    expected = grad_permuted.index_select(0, sorted_indices.long()).reshape(4, 2, 3).sum(1)
    assert grad_tokens.dtype == torch.bfloat16
    torch.testing.assert_close(grad_tokens.float(), expected, rtol=1e-2, atol=1e-2)
    grad_out, probs, permuted = torch.randn(4, 3, generator=g), torch.rand(4, 2, generator=g), torch.randn(8, 3, generator=g)
    grad_permuted, grad_probs = npu.npu_moe_token_unpermute_grad_v2.default(
        grad_out, sorted_indices, 8, torch.float32, probs, permuted_tokens=permuted)
    expected = torch.empty(8, 3)
    expected[sorted_indices.long()] = (grad_out.unsqueeze(1) * probs.unsqueeze(-1)).reshape(-1, 3)
    torch.testing.assert_close(grad_permuted, expected)
    torch.testing.assert_close(grad_probs, (permuted[sorted_indices.long()].reshape(4, 2, 3) * grad_out.unsqueeze(1)).sum(-1))
    one = torch.tensor([2, 0, 3, 1], dtype=torch.int32)  # topK 1
    no_probs, placeholder = npu.npu_moe_token_unpermute_grad_v2.default(grad_out, one, 4, torch.float32)
    assert placeholder.shape == (0,)
    torch.testing.assert_close(no_probs[one.long()], grad_out)


def test_opcheck(simulated_npu_ops):
    x, ids, probs = _case(torch.float32)
    torch.library.opcheck(npu.npu_moe_token_permute.default, (x.requires_grad_(), ids))
    permuted, sorted_indices = npu.npu_moe_token_permute.default(x.detach(), ids)
    torch.library.opcheck(npu.npu_moe_token_unpermute.default,
                          (permuted.requires_grad_(), sorted_indices, probs.requires_grad_()))
    torch.library.opcheck(npu.npu_moe_token_permute_grad_v2.default, (permuted.detach(), sorted_indices, 5, torch.float32, 2))
    torch.library.opcheck(npu.npu_moe_token_unpermute_grad_v2.default,
                          (torch.randn(5, 8), sorted_indices, 10, torch.float32, probs.detach(), False, None,
                           permuted.detach()))


def test_limits_raise_with_the_reason(simulated_npu_ops):
    x, ids, probs = _case(torch.float32)
    with pytest.raises(RuntimeError, match="int32/int64"):
        npu.npu_moe_token_permute.default(x, ids.float())
    with pytest.raises(RuntimeError, match="padded_mode"):
        npu.npu_moe_token_permute.default(x, ids, None, True)
    _, sorted_indices = npu.npu_moe_token_permute.default(x, ids)
    with pytest.raises(RuntimeError, match="sorted_indices must be int32"):
        npu.npu_moe_token_unpermute.default(x.repeat(2, 1), sorted_indices.long(), probs)
    assert mtp.unpermute_violation(x, sorted_indices, torch.rand(1, 600).expand(10, 600)) is not None


# the stand-ins against the torch_npu wheel (schemas, meta kernels); skipped without the cached wheel


@pytest.fixture(scope="module")
def sources():
    return torchair_wheel_sources()


def test_schemas_and_meta_equal_the_wheels(simulated_npu_ops, sources):
    from torch._subclasses.fake_tensor import FakeTensorMode

    from tests.helpers.wheel_contracts import describe, load_meta_kernels, schema_mismatches

    assert schema_mismatches(sources.schemas_yaml, list(mtp.OPS)) == {}
    meta = load_meta_kernels(sources.meta_registrations).functions
    x, ids, probs = _case(torch.bfloat16)
    permuted, sorted_indices = npu.npu_moe_token_permute.default(x, ids)
    calls = {
        "npu_moe_token_permute": ((x, ids), {}),
        "npu_moe_token_unpermute": ((permuted, sorted_indices), {"probs": probs}),
        "npu_moe_token_permute_grad_v2": ((permuted, sorted_indices, 5, torch.bfloat16, 2), {}),
        "npu_moe_token_unpermute_grad_v2": ((x, sorted_indices, 10, torch.bfloat16), {"probs": probs}),
    }
    for name, (args, kwargs) in calls.items():
        to_meta = lambda v: v.to("meta") if isinstance(v, torch.Tensor) else v  # noqa: E731
        theirs = describe(meta[name](*map(to_meta, args), **{k: to_meta(v) for k, v in kwargs.items()}))
        with FakeTensorMode() as mode:
            fake = lambda v: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v  # noqa: E731
            ours = describe(getattr(npu, name).default(*map(fake, args), **{k: fake(v) for k, v in kwargs.items()}))
        assert ours == theirs, name
