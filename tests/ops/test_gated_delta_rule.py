"""``qwen_npu::chunk_gated_delta_rule`` against transformers' own ``torch_chunk_gated_delta_rule``: forward and
backward, fp32 and bf16, padded and packed rows (lengths at the chunk edges), an initial state, opcheck, fake
shapes under a dynamic token count, the limits, and the NPU argument translation against a stand-in that
follows torch_npu's documented contract."""

from __future__ import annotations

import itertools

import pytest
import torch

from qwen_npu_compile.npu_ops import gated_delta_rule as G

modeling = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
hf_rule = modeling.torch_chunk_gated_delta_rule

OP = torch.ops.qwen_npu.chunk_gated_delta_rule.default
HEAD_DIM = 128  # Qwen3.5 / Qwen3-Next linear_key_head_dim and linear_value_head_dim


def _operands(batch, tokens, heads=2, dim=HEAD_DIM, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    q, k, v = (torch.randn(batch, tokens, heads, dim).to(dtype) for _ in range(3))
    g = -torch.rand(batch, tokens, heads) * 0.3  # fp32, as the DeltaNet computes it
    beta = torch.rand(batch, tokens, heads).to(dtype)
    return [t.requires_grad_() for t in (q, k, v, g, beta)]


def _grads(outputs, inputs, seed=1):
    torch.manual_seed(seed)
    cotangents = [torch.randn(o.shape, dtype=o.dtype) for o in outputs]  # not randn_like: it follows strides
    return torch.autograd.grad(outputs, inputs, cotangents)


def _rel(a, b):
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_padded_with_initial_state_matches_transformers(dtype, tol):
    q, k, v, g, beta = _operands(2, 100, dtype=dtype)
    state = (torch.randn(2, 2, HEAD_DIM, HEAD_DIM) * 0.05).requires_grad_()
    inputs = [q, k, v, g, beta, state]
    out, final = OP(q, k, v, g, beta, None, state, HEAD_DIM ** -0.5, True)
    ref_out, ref_final = hf_rule(q, k, v, g, beta, initial_state=state, output_final_state=True,
                                 use_qk_l2norm_in_kernel=True)
    assert out.dtype == ref_out.dtype == dtype and final.dtype == torch.float32
    assert _rel(out, ref_out) <= tol and _rel(final, ref_final) <= tol
    for ours, theirs in zip(_grads((out, final), inputs), _grads((ref_out, ref_final), inputs)):
        assert _rel(ours, theirs) <= tol


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_packed_rows_equal_each_sequence_alone(dtype, tol):
    lengths = [1, 63, 64, 65, 130]  # a single token and the chunk edges
    q, k, v, g, beta = _operands(1, sum(lengths), dtype=dtype)
    cu_seqlens = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    state = (torch.randn(len(lengths), 2, HEAD_DIM, HEAD_DIM) * 0.05).requires_grad_()
    inputs = [q, k, v, g, beta, state]
    out, final = OP(q, k, v, g, beta, cu_seqlens, state, HEAD_DIM ** -0.5, True)
    ref = [hf_rule(*(t[:, a:b] for t in (q, k, v, g, beta)), initial_state=state[i:i + 1], output_final_state=True,
                   use_qk_l2norm_in_kernel=True)
           for i, (a, b) in enumerate(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()))]
    ref_out, ref_final = torch.cat([r[0] for r in ref], dim=1), torch.cat([r[1] for r in ref])
    assert _rel(out, ref_out) <= tol and _rel(final, ref_final) <= tol
    for ours, theirs in zip(_grads((out, final), inputs), _grads((ref_out, ref_final), inputs)):
        assert _rel(ours, theirs) <= tol


def test_packing_is_not_one_sequence():
    """The offsets change the result (a test that would pass with cu_seqlens ignored is not one)."""
    q, k, v, g, beta = (t.detach() for t in _operands(1, 130))
    packed, _ = OP(q, k, v, g, beta, torch.tensor([0, 65, 130]), None, HEAD_DIM ** -0.5, True)
    whole, _ = OP(q, k, v, g, beta, None, None, HEAD_DIM ** -0.5, True)
    assert torch.equal(packed[:, :65], whole[:, :65]) and _rel(packed[:, 65:], whole[:, 65:]) > 1e-2


def test_opcheck():
    q, k, v, g, beta = (t.detach() for t in _operands(1, 70, dim=32))
    cu = torch.tensor([0, 5, 70])
    state = torch.randn(2, 2, 32, 32) * 0.05
    for args in [(q, k, v, g, beta, None, None, 32 ** -0.5, True), (q, k, v, g, beta, cu, state, 0.2, False)]:
        args = tuple(t.clone().requires_grad_() if isinstance(t, torch.Tensor) and t.is_floating_point() else t
                     for t in args)
        torch.library.opcheck(OP, args)


def test_fake_shapes_under_dynamic_tokens():
    """One graph for every T and every number of sequences: the op's shapes follow its inputs symbolically."""
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("aot_eager")

    @torch.compile(backend=counter, dynamic=True, fullgraph=True)
    def run(q, k, v, g, beta, cu):
        out, final = OP(q, k, v, g, beta, cu, None, HEAD_DIM ** -0.5, True)
        return out.sum() + final.sum(), final.shape[0]

    for tokens, cu in [(70, [0, 70]), (200, [0, 1, 64, 200]), (131, [0, 63, 65, 100, 131])]:
        q, k, v, g, beta = _operands(1, tokens)
        cu = torch.tensor(cu)
        torch._dynamo.decorators.mark_unbacked(cu, 0)
        total, sequences = run(q, k, v, g, beta, cu)
        assert sequences == len(cu) - 1
        total.backward()
    assert counter.frame_count == 1


@pytest.mark.parametrize("change,reason", [
    (lambda a: a.__setitem__(1, a[1][..., :1, :]), "key"),
    (lambda a: a.__setitem__(3, a[3][..., :1]), "g "),
    (lambda a: a.__setitem__(5, torch.tensor([0.0, 4.0])), "cu_seqlens"),
    (lambda a: a.__setitem__(6, torch.zeros(3, 2, 8, 8)), "initial_state"),
])
def test_limits_refuse_with_a_reason(change, reason):
    args = [*(t.detach() for t in _operands(1, 4, dim=8)), torch.tensor([0, 4]), None]
    change(args)
    message = G.violation(*args)
    assert message is not None and reason in message
    with pytest.raises(ValueError, match="qwen_npu::chunk_gated_delta_rule"):
        G.reference(*args)


def _npu_stand_in(query, key, value, *, beta, initial_state, actual_seq_lengths, scale, g):
    """torch_npu's documented contract (op-plugin ChunkGatedDeltaRuleKernelNpuOpApi.cpp, lite_boost docs): TND
    bf16, state value-first [N, Nv, Dv, Dk], lengths int32, no l2norm inside, out bf16. Token by token."""
    assert value.dim() == 3 and query.dtype == torch.bfloat16 and actual_seq_lengths.dtype == torch.int32
    outs, finals, start = [], [], 0
    for n, length in enumerate(actual_seq_lengths.tolist()):
        state = initial_state[n].float()  # [H, Dv, Dk]
        for t in range(start, start + length):
            alpha = g[t].exp()[:, None, None]
            state = alpha * state
            delta = beta[t].float()[:, None] * (value[t].float() - (state @ key[t].float()[..., None])[..., 0])
            state = state + delta[..., None] * key[t].float()[:, None, :]
            outs.append((state @ query[t].float()[..., None])[..., 0] * scale)
        finals.append(state)
        start += length
    return torch.stack(outs).to(torch.bfloat16), torch.stack(finals).to(initial_state.dtype)


def test_npu_forward_translation_matches_the_reference():
    """What the Ascend kernel hands npu_chunk_gated_delta_rule (TND, lengths, value-first state, l2norm outside)
    gives the reference's result on a stand-in that follows the op's documented recurrence."""
    q, k, v, g, beta = (t.detach() for t in _operands(1, 40, dim=16, dtype=torch.bfloat16))
    cu = torch.tensor([0, 7, 40])
    state = torch.randn(2, 2, 16, 16) * 0.05
    got = G.npu_forward(q, k, v, g, beta, cu, state, 16 ** -0.5, True, npu_op=_npu_stand_in)
    want = G.reference(q, k, v, g, beta, cu, state, 16 ** -0.5, True)
    assert _rel(got[0], want[0]) < 2e-2 and _rel(got[1], want[1]) < 2e-2
    assert G.npu_forward(q.float(), k, v.float(), g, beta, cu, state, 0.25, True, npu_op=_npu_stand_in) is None
