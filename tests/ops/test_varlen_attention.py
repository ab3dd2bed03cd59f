"""``qwen_npu::varlen_attention`` / ``varlen_attention_backward`` / ``seq_ends_from_positions`` and the
simulated ``npu_fusion_attention(_grad)`` in TND, against a per-sequence SDPA reference."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from qwen_npu_compile.ops import limits
from qwen_npu_compile.ops.attention_contract import compressed_causal_mask
from qwen_npu_compile.ops.qwen_npu import varlen_attention as va
from tests.helpers.graphs import aot_traced, call_targets
from tests.helpers.models import packed_positions
from tests.helpers.tensors import meta, random_qkv

pytestmark = pytest.mark.usefixtures("simulated_npu_ops")

LENS = [5, 17, 1, 9]  # T = 32


def fa(*args, **kwargs):
    return torch.ops.npu.npu_fusion_attention.default(*args, **kwargs)


def tnd_qkv(lens, nq, nkv, d, dtype=torch.float32, dv=None, seed=0):
    """TND ``q, k, v`` of sequences of ``lens`` (``nq`` / ``nkv`` heads, head dim ``d``, value dim ``dv``)."""
    t = sum(lens)
    return random_qkv((t, nq, d), (t, nkv, d), dtype, v_shape=(t, nkv, dv or d), seed=seed)


def ends_of(lens):
    return torch.tensor(lens, dtype=torch.int64).cumsum(0)


def reference(q, k, v, lens, scale, causal=True, kv_lens=None, right_down=True):
    """Per-sequence SDPA in fp32 (repeat_kv for GQA), TND in and out."""
    group = q.shape[1] // k.shape[1]
    outs, qs, ks = [], 0, 0
    for sq, skv in zip(lens, kv_lens or lens):
        qi = q[qs:qs + sq].float().transpose(0, 1)
        ki = k[ks:ks + skv].float().transpose(0, 1).repeat_interleave(group, 0)
        vi = v[ks:ks + skv].float().transpose(0, 1).repeat_interleave(group, 0)
        mask = None
        if causal:
            i, j = torch.arange(sq).unsqueeze(-1), torch.arange(skv)
            mask = j <= i + (skv - sq if right_down else 0)  # SDPA: True = attend
        outs.append(F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale).transpose(0, 1))
        qs, ks = qs + sq, ks + skv
    return torch.cat(outs)


def grads(out, inputs, dy):
    return torch.autograd.grad(out, inputs, dy)


# ---------------------------------------------------------------------------------------------------------
# values and gradients


@pytest.mark.parametrize("nq,nkv,d", [(4, 2, 64), (14, 2, 128), (4, 4, 64)])
def test_fp32_values_and_gradients_match_per_sequence_sdpa(nq, nkv, d):
    q, k, v = tnd_qkv(LENS, nq, nkv, d)
    scale = d ** -0.5
    out, softmax_max, softmax_sum = va.OP(q, k, v, ends_of(LENS), nq, scale)
    expected = reference(q, k, v, LENS, scale)
    assert out.shape == (32, nq, d) and out.dtype == torch.float32
    assert softmax_max.shape == softmax_sum.shape == (32, nq, 8) and softmax_max.dtype == torch.float32
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=2e-5)
    dy = torch.randn_like(out)
    for got, want in zip(grads(out, (q, k, v), dy), grads(expected, (q, k, v), dy)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_bf16_within_bf16_rounding_of_the_fp32_reference():
    q, k, v = tnd_qkv(LENS, 4, 2, 64, torch.bfloat16)
    out, _, _ = va.OP(q, k, v, ends_of(LENS), 4, 0.125)
    assert out.dtype == torch.bfloat16
    expected = reference(q, k, v, LENS, 0.125)  # fp32 math on the bf16 inputs
    rel = (out.float() - expected).norm() / expected.norm()
    assert rel < 8e-3, rel
    dy = torch.randn(out.shape).to(torch.bfloat16)
    for got, want in zip(grads(out, (q, k, v), dy), grads(expected, (q, k, v), dy.float())):
        assert got.dtype == torch.bfloat16
        assert (got.float() - want.float()).norm() / want.float().norm() < 1e-2


def test_softmax_statistics_are_the_row_max_and_sum_of_each_sequence():
    q, k, v = tnd_qkv(LENS, 4, 2, 64)
    _, softmax_max, softmax_sum = va.OP(q, k, v, ends_of(LENS), 4, 0.125)
    start = 0
    for n in LENS:
        qi, ki = q[start:start + n].transpose(0, 1), k[start:start + n].transpose(0, 1).repeat_interleave(2, 0)
        s = (qi @ ki.transpose(-1, -2) * 0.125).masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        row_max = s.amax(-1)  # [N, S]
        row_sum = (s - row_max.unsqueeze(-1)).exp().sum(-1)
        torch.testing.assert_close(softmax_max[start:start + n], row_max.T.unsqueeze(-1).expand(n, 4, 8))
        torch.testing.assert_close(softmax_sum[start:start + n], row_sum.T.unsqueeze(-1).expand(n, 4, 8))
        start += n


def test_sparse_modes_two_and_three_agree_and_zero_is_unmasked():
    q, k, v = tnd_qkv(LENS, 4, 2, 64)
    ends = ends_of(LENS)
    mode3 = va.OP(q, k, v, ends, 4, 0.125)[0]
    torch.testing.assert_close(va.OP(q, k, v, ends, 4, 0.125, 2)[0], mode3, atol=0, rtol=0)
    mode0 = va.OP(q, k, v, ends, 4, 0.125, 0)[0]
    torch.testing.assert_close(mode0, reference(q, k, v, LENS, 0.125, causal=False), atol=2e-6, rtol=2e-5)
    assert not torch.allclose(mode0, mode3)


@pytest.mark.parametrize("mode", [2, 3])
def test_stand_in_tnd_with_different_query_and_key_lengths(mode):
    # cross-length sequences: left-up (2) masks j > i, right-down (3) masks j > i + Skv - Sq
    q_lens, kv_lens = [3, 5], [5, 7]
    q, _, _ = tnd_qkv(q_lens, 4, 2, 64)
    _, k, v = tnd_qkv(kv_lens, 4, 2, 64, seed=1)
    q_ends, kv_ends = ends_of(q_lens).tolist(), ends_of(kv_lens).tolist()
    out = fa(q, k, v, 4, "TND", atten_mask=compressed_causal_mask(), scale=0.125, actual_seq_qlen=q_ends,
             actual_seq_kvlen=kv_ends, sparse_mode=mode)[0]
    expected = reference(q, k, v, q_lens, 0.125, kv_lens=kv_lens, right_down=mode == 3)
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=2e-5)
    dy = torch.randn_like(out)
    for got, want in zip(grads(out, (q, k, v), dy), grads(expected, (q, k, v), dy)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_stand_in_tnd_skips_an_empty_sequence():
    # the stand-in's offsets only need to be non-decreasing: an empty sequence contributes nothing
    q, k, v = tnd_qkv([16, 16], 4, 2, 64)
    mask = compressed_causal_mask()
    with_empty = fa(q, k, v, 4, "TND", atten_mask=mask, scale=0.125, actual_seq_qlen=[16, 16, 32],
                    actual_seq_kvlen=[16, 16, 32], sparse_mode=3)
    without = fa(q, k, v, 4, "TND", atten_mask=mask, scale=0.125, actual_seq_qlen=(16, 32), actual_seq_kvlen=(16, 32),
                 sparse_mode=3)
    for a, b in zip(with_empty[:3], without[:3]):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    # the op itself takes strictly increasing offsets only (varlen_violation)
    with pytest.raises(RuntimeError, match="strictly increasing"):
        va.OP(q, k, v, torch.tensor([16, 16, 32]), 4, 0.125)


# ---------------------------------------------------------------------------------------------------------
# transformers' own NPU flash-attention functions, on the stand-in


@pytest.fixture
def npu_flash(monkeypatch):
    from transformers.integrations import npu_flash_attention

    monkeypatch.setattr(npu_flash_attention, "npu_fusion_attention", torch.ops.npu.npu_fusion_attention, raising=False)
    return npu_flash_attention


@pytest.mark.parametrize("causal", [True, False])
def test_transformers_npu_flash_attn_varlen_func(npu_flash, causal):
    q, k, v = tnd_qkv(LENS, 4, 2, 64)
    cu = torch.tensor([0, *ends_of(LENS).tolist()], dtype=torch.int32)
    out = npu_flash.npu_flash_attn_varlen_func(q, k, v, cu, cu, max(LENS), max(LENS), causal=causal)
    expected = reference(q, k, v, LENS, 64 ** -0.5, causal=causal)
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=2e-5)
    dy = torch.randn_like(out)
    for got, want in zip(grads(out, (q, k, v), dy), grads(expected, (q, k, v), dy)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_transformers_npu_flash_attn_func_single_sequence_bsnd(npu_flash):
    q, k, v = tnd_qkv([12], 4, 2, 64)
    out = npu_flash.npu_flash_attn_func(q[None], k[None], v[None], causal=True)  # [1, S, N, D] BSND
    torch.testing.assert_close(out[0], reference(q, k, v, [12], 0.125), atol=2e-6, rtol=2e-5)
    torch.testing.assert_close(out[0], va.OP(q, k, v, ends_of([12]), 4, 0.125)[0], atol=2e-6, rtol=2e-5)


# ---------------------------------------------------------------------------------------------------------
# tracing: symbolic T, unbacked B, AOTAutograd


def _attention_from_positions(q, k, v, position_ids):
    return va.OP(q, k, v, va.SEQ_ENDS_OP(position_ids, "restart"), 4, 0.125)[0]


def test_make_fx_symbolic_traces_symbolic_t_and_unbacked_sequence_count():
    q, k, v = (t.detach() for t in tnd_qkv(LENS, 4, 2, 64))
    gm = make_fx(_attention_from_positions, tracing_mode="symbolic")(q, k, v, packed_positions(LENS))
    assert call_targets(gm).count(va.OP) == 1 and call_targets(gm).count(va.SEQ_ENDS_OP) == 1
    [ends] = gm.graph.find_nodes(op="call_function", target=va.SEQ_ENDS_OP)
    count = ends.meta["val"].shape[0]
    assert isinstance(count, torch.SymInt) and str(count).startswith("u")  # data-dependent B
    assert ends.meta["val"].device.type == "cpu" and ends.meta["val"].dtype == torch.int64
    [attention] = gm.graph.find_nodes(op="call_function", target=va.OP)
    out_shape = attention.meta["val"][0].shape
    assert isinstance(out_shape[0], torch.SymInt) and list(out_shape[1:]) == [4, 64]
    # the traced graph runs another packing, another T
    lens = [3, 3, 10, 6]
    q2, k2, v2 = (t.detach() for t in tnd_qkv(lens, 4, 2, 64, seed=3))
    torch.testing.assert_close(gm(q2, k2, v2, packed_positions(lens)), reference(q2, k2, v2, lens, 0.125), atol=2e-6, rtol=2e-5)


def test_aot_autograd_backward_graph_holds_varlen_attention_backward():
    compiled, graphs = aot_traced(lambda q, k, v, ends: va.OP(q, k, v, ends, 4, 0.125)[0])
    q, k, v = tnd_qkv(LENS, 4, 2, 64)
    out = compiled(q, k, v, ends_of(LENS))
    dy = torch.randn_like(out)
    got = grads(out, (q, k, v), dy)
    assert call_targets(graphs["fw"]).count(va.OP) == 1
    assert call_targets(graphs["bw"]).count(va.BACKWARD_OP) == 1
    assert torch.ops.npu.npu_fusion_attention.default not in call_targets(graphs["fw"])
    expected = reference(q, k, v, LENS, 0.125)
    for g, w in zip(got, grads(expected, (q, k, v), dy)):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("fullgraph", [True, False])
def test_compile_dynamic_one_graph_pair_for_every_packing(fullgraph):
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    compiled = torch.compile(_attention_from_positions, fullgraph=fullgraph, dynamic=True,
                             backend=aot_autograd(fw_compiler=record, bw_compiler=record))
    for seed, lens in enumerate([LENS, [3, 3, 10], [7, 7, 7, 7, 7, 1]]):
        q, k, v = tnd_qkv(lens, 4, 2, 64, seed=seed)
        out = compiled(q, k, v, packed_positions(lens))
        dy = torch.randn_like(out)
        got = grads(out, (q, k, v), dy)
        expected = reference(q, k, v, lens, 0.125)
        torch.testing.assert_close(out, expected, atol=2e-6, rtol=2e-5)
        for g, w in zip(got, grads(expected, (q, k, v), dy)):
            torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4)
    assert len(graphs) == 2  # one forward, one backward, for three packings (T and B change)
    forward, backward = graphs
    assert call_targets(forward).count(va.SEQ_ENDS_OP) == 1 and call_targets(forward).count(va.OP) == 1
    assert call_targets(backward).count(va.BACKWARD_OP) == 1


# ---------------------------------------------------------------------------------------------------------
# no T x T tensor


def _profiled_shapes(fn) -> list[tuple[str, tuple]]:
    """``(op, input shape)`` of every op the profiler records while ``fn`` runs, nested ones included (the
    aten ops inside the custom ops' Python kernels, which a TorchDispatchMode would not see)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    return [(event.name, tuple(shape)) for event in prof.events() for shape in event.input_shapes if shape]


def _square(shapes, tokens):
    return [(op, s) for op, s in shapes if len(s) >= 2 and s[-2:] == (tokens, tokens)]


def test_no_tensor_of_t_by_t_forward_and_backward():
    lens = [16, 16, 16, 16]
    q, k, v = tnd_qkv(lens, 4, 2, 64)
    ends = ends_of(lens)

    def step():
        out = va.OP(q, k, v, ends, 4, 0.125)[0]
        out.backward(torch.ones_like(out))

    shapes = _profiled_shapes(step)
    names = {op for op, _ in shapes}
    assert {"qwen_npu::varlen_attention", "qwen_npu::varlen_attention_backward", "aten::bmm"} <= names, names
    assert _square(shapes, 64) == []
    assert (16, 16) in {s[-2:] for _, s in shapes if len(s) >= 2}  # the per-sequence scores were seen
    # the detector does see the dense path's scores (the same 64 tokens as one BSND sequence)
    dense = _profiled_shapes(lambda: fa(q[None], k[None], v[None], 4, "BSND", atten_mask=compressed_causal_mask(),
                                        scale=0.125, sparse_mode=3))
    assert _square(dense, 64) != []


# ---------------------------------------------------------------------------------------------------------
# seq_ends_from_positions / host_seq_ends


@pytest.mark.parametrize("rule,expected", [("restart", [3, 5, 7]), ("zero", [5, 7])])
def test_seq_ends_rules(rule, expected):
    row = torch.tensor([0, 1, 2, 7, 8, 0, 1])  # restarts at 7 (not 0): "restart" splits there, "zero" does not
    for position_ids in (row[None], row, row[None].int()):
        ends = va.SEQ_ENDS_OP(position_ids, rule)
        assert ends.dtype == torch.int64 and ends.device.type == "cpu" and ends.tolist() == expected
        assert va.host_seq_ends(position_ids, rule).tolist() == expected
        assert va.seq_ends_from_positions(position_ids, rule).tolist() == expected


def test_seq_ends_first_position_always_starts_a_sequence():
    row = torch.tensor([[4, 5, 0, 1, 2]])
    assert va.SEQ_ENDS_OP(row, "restart").tolist() == [2, 5]
    assert va.SEQ_ENDS_OP(row, "zero").tolist() == [2, 5]
    assert va.SEQ_ENDS_OP(torch.tensor([[0]]), "restart").tolist() == [1]
    assert va.host_seq_ends(torch.arange(6)[None]).tolist() == [6]  # default rule "restart"


@pytest.mark.parametrize(
    "position_ids,rule,match",
    [
        (torch.arange(8).reshape(2, 4), "restart", r"\[1, T\] or \[T\]"),
        (torch.arange(8).reshape(1, 2, 4), "restart", "one row"),
        (torch.arange(4).float()[None], "restart", "integer"),
        (torch.zeros(1, 0, dtype=torch.int64), "zero", "empty"),
        (torch.arange(4)[None], "first", "rule"),
    ],
)
def test_seq_ends_refusals(position_ids, rule, match):
    with pytest.raises(RuntimeError, match=match):
        va.SEQ_ENDS_OP(position_ids, rule)
    with pytest.raises(RuntimeError, match=match):
        va.host_seq_ends(position_ids, rule)
    with pytest.raises(RuntimeError, match=match):  # the fake kernel too
        make_fx(lambda p: va.SEQ_ENDS_OP(p, rule), tracing_mode="symbolic")(position_ids)


# ---------------------------------------------------------------------------------------------------------
# limits: varlen_violation and the refusals


#: meta tensors here default to bf16, a dtype the varlen kernel takes everywhere
_meta = functools.partial(meta, dtype=torch.bfloat16)


def _violation(case):
    q, k, v = _meta(64, 4, 64), _meta(64, 2, 64), _meta(64, 2, 64)
    ends = torch.tensor([16, 40, 64])
    cases = {
        "tokens": lambda: va.varlen_violation(_meta(2**20 + 1, 4, 64), _meta(2**20 + 1, 2, 64), _meta(2**20 + 1, 2, 64)),
        "heads": lambda: va.varlen_violation(_meta(64, 512, 64), _meta(64, 512, 64), _meta(64, 512, 64)),
        "head-dim": lambda: va.varlen_violation(_meta(64, 4, 1024), _meta(64, 2, 1024), _meta(64, 2, 1024)),
        "value-dim": lambda: va.varlen_violation(q, k, _meta(64, 2, 128)),
        "gqa": lambda: va.varlen_violation(q, _meta(64, 3, 64), _meta(64, 3, 64)),
        "head-num": lambda: va.varlen_violation(q, k, v, ends, 8),
        "dtype-mix": lambda: va.varlen_violation(q, _meta(64, 2, 64, dtype=torch.float16), v),
        "dtype": lambda: va.varlen_violation(*(_meta(64, 2, 64, dtype=torch.float64) for _ in range(3))),
        "rank": lambda: va.varlen_violation(_meta(1, 64, 4, 64), k, v),
        "key-tokens": lambda: va.varlen_violation(q, _meta(32, 2, 64), _meta(32, 2, 64)),
        "segments": lambda: va.varlen_violation(_meta(2049, 4, 64), _meta(2049, 2, 64), _meta(2049, 2, 64),
                                                torch.arange(1, 2050)),
        "ends-at-t": lambda: va.varlen_violation(q, k, v, torch.tensor([16, 40])),
        "increasing": lambda: va.varlen_violation(q, k, v, torch.tensor([16, 16, 64])),
        "ends-dtype": lambda: va.varlen_violation(q, k, v, ends.int()),
        "sparse-mode": lambda: va.varlen_violation(q, k, v, ends, sparse_mode=1),
        "torchair-fp32": lambda: va.varlen_violation(*(_meta(64, 2, 64, dtype=torch.float32) for _ in range(3)),
                                                     downstream="torchair"),
    }  # fmt: skip
    return cases[case]()


@pytest.mark.parametrize(
    "case,match",
    [("tokens", "1048576"), ("heads", "256"), ("head-dim", "768"), ("value-dim", "Dv <= D"), ("gqa", "multiple"),
     ("head-num", "head_num=8"), ("dtype-mix", "dtypes differ"), ("dtype", "unsupported dtype"), ("rank", "3-D"),
     ("key-tokens", "self-attention"), ("segments", "2049 sequences > 2048"), ("ends-at-t", "CANN >= 9.0"),
     ("increasing", "strictly increasing"), ("ends-dtype", "int64"), ("sparse-mode", "sparse_mode=1"),
     ("torchair-fp32", "fp16/bf16")],
)  # fmt: skip
def test_each_limit_gives_its_reason(case, match):
    reason = _violation(case)
    assert reason is not None and re_search(match, reason), reason


def re_search(pattern, text):
    import re

    return re.search(pattern, text) is not None


def test_supported_calls_have_no_violation():
    q, k, v = _meta(64, 4, 64), _meta(64, 2, 64), _meta(64, 2, 64)
    assert va.varlen_violation(q, k, v) is None
    assert va.varlen_violation(q, k, v, torch.tensor([16, 40, 64]), 4, downstream="torchair") is None
    assert va.varlen_violation(_meta(2**20, 4, 64), _meta(2**20, 2, 64), _meta(2**20, 2, 64),
                               torch.tensor([2**19, 2**20])) is None  # T = 1M exactly
    ends = torch.arange(1, 2049)  # 2048 sequences of one token
    assert va.varlen_violation(_meta(2048, 4, 64), _meta(2048, 2, 64), _meta(2048, 2, 64), ends) is None
    assert va.varlen_violation(q, k, v, torch.empty(3, dtype=torch.int64, device="meta")) is None  # values unknown


def test_op_and_fake_raise_the_reason():
    q, k, v = tnd_qkv(LENS, 4, 2, 64)
    with pytest.raises(RuntimeError, match="qwen_npu::varlen_attention: .*CANN >= 9.0"):
        va.OP(q, k, v, torch.tensor([5, 22]), 4, 0.125)
    with pytest.raises(RuntimeError, match="int64"):
        va.OP(q, k, v, ends_of(LENS).int(), 4, 0.125)
    with pytest.raises(RuntimeError, match="multiple"):  # the fake kernel, while tracing
        make_fx(lambda q, k: va.OP(q, k, k, ends_of(LENS), 4, 0.125)[0], tracing_mode="symbolic")(
            q.detach(), torch.randn(32, 3, 64))
    out, smax, ssum = va.OP(q, k, v, ends_of(LENS), 4, 0.125)
    with pytest.raises(RuntimeError, match="dy shape"):
        va.BACKWARD_OP(out[:, :2], q, k, v, out, smax, ssum, ends_of(LENS), 4, 0.125)


def test_graph_limits_lookup_covers_the_varlen_ops():
    q, k, v = (t.detach() for t in tnd_qkv(LENS, 4, 2, 64))
    gm = make_fx(_attention_from_positions, tracing_mode="symbolic")(q, k, v, packed_positions(LENS))
    [node] = gm.graph.find_nodes(op="call_function", target=va.OP)
    assert "fp16/bf16" in limits.node_violation(node, "torchair")  # fp32 q/k/v: GE refuses
    assert limits.node_violation(node, None) is None
    gm16 = make_fx(_attention_from_positions, tracing_mode="symbolic")(q.bfloat16(), k.bfloat16(), v.bfloat16(),
                                                                        packed_positions(LENS))
    assert limits.graph_violations(gm16.graph, "torchair") == []


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(), "needs actual_seq_qlen"),
        (dict(keep_prob=0.9), "keep_prob=0.9"),
        (dict(pse=torch.zeros(1, 4, 32, 32)), "pse"),
        (dict(atten_mask=torch.ones(32, 32, dtype=torch.bool)), "explicit atten_mask"),
        (dict(atten_mask=torch.ones(32, 32, dtype=torch.bool), sparse_mode=3), "compressed"),
        (dict(atten_mask=torch.zeros(2048, 2048, dtype=torch.bool), sparse_mode=3), "compressed"),
        (dict(actual_seq_qlen=[5, 30], actual_seq_kvlen=[5, 32]), "not at T=32"),
        (dict(actual_seq_qlen=[20, 32], actual_seq_kvlen=[10, 32], sparse_mode=3), "Sq=20 > Skv=10"),
        (dict(actual_seq_qlen=[16, 32], actual_seq_kvlen=[32]), "same sequences"),
    ],
)  # fmt: skip
def test_stand_in_tnd_refusals(kwargs, match):
    q, k, v = (t.detach() for t in tnd_qkv([16, 16], 4, 2, 64))
    kwargs = dict(kwargs)
    if "actual_seq_qlen" not in kwargs and kwargs:
        kwargs.update(actual_seq_qlen=[16, 32], actual_seq_kvlen=[16, 32])
    if kwargs.get("sparse_mode") == 3 and "atten_mask" not in kwargs:
        kwargs["atten_mask"] = compressed_causal_mask()
    with pytest.raises(RuntimeError, match=match):
        fa(q, k, v, 4, "TND", scale=0.125, **kwargs)


def test_stand_in_tnd_fake_matches_the_wheels_meta_kernel():
    from qwen_npu_compile.torchair.offline import wheel
    from tests.helpers.wheel_contracts import load_meta_kernels, output_differences

    kernels = load_meta_kernels(wheel.obtain_sources(torch.__version__).meta_registrations)
    q, k, v = (t.detach().bfloat16() for t in tnd_qkv(LENS, 4, 2, 64))
    ends = ends_of(LENS).tolist()
    common = dict(atten_mask=compressed_causal_mask(), actual_seq_qlen=ends, actual_seq_kvlen=ends, sparse_mode=3)
    stats = torch.rand(32, 4, 8)
    forward = output_differences("npu_fusion_attention", kernels.functions["npu_fusion_attention"],
                                 (q, k, v, 4, "TND"), dict(common, scale=0.125))
    assert forward == {}
    backward = output_differences("npu_fusion_attention_grad", kernels.functions["npu_fusion_attention_grad"],
                                  (q, k, v, q, 4, "TND"), dict(common, softmax_max=stats, softmax_sum=stats,
                                                               attention_in=q, scale_value=0.125))
    assert set(backward) == {3}  # dpse: the wheel's Meta gives None, the stand-in an empty [0] (as for BSH)


def test_opcheck():
    # schema, fake kernel, autograd registration and AOTAutograd (static and dynamic) of each op
    q, k, v = tnd_qkv([3, 6, 2], 4, 2, 64)
    ends = ends_of([3, 6, 2])
    torch.library.opcheck(va.OP, (q, k, v, ends, 4, 0.125))
    out, smax, ssum = (t.detach() for t in va.OP(q, k, v, ends, 4, 0.125))
    torch.library.opcheck(va.BACKWARD_OP, (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out, smax, ssum,
                                           ends, 4, 0.125))
    torch.library.opcheck(va.SEQ_ENDS_OP, (torch.tensor([[0, 1, 2, 0, 1]]), "zero"))
