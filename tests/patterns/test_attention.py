"""Attention -> npu_fusion_attention on transformers' real Qwen2 code: exact counts, parity, refusals."""

from __future__ import annotations

import types
import unittest.mock

import pytest
import torch
import torch.nn.functional as F
import transformers

from qwen_npu_compile import backend, get_reports
from qwen_npu_compile.cli.check.models import tiny_qwen2
from qwen_npu_compile.cli.check.parity import FP32_TOLERANCE, relative_l2
from qwen_npu_compile.config import QwenNpuConfig
from qwen_npu_compile.fusion.family import CompileTarget
from qwen_npu_compile.ops import NpuOpsStatus
from qwen_npu_compile.patterns import get_family_pass
from qwen_npu_compile.patterns.attention import check_attention
from qwen_npu_compile.patterns.attention import varlen as attention_varlen
from tests.helpers.numerics import assert_parity
from tests.helpers.tensors import meta

LAYERS = 2
ATTN = {"fusions": "attention"}
#: head_dim 64 with GQA (n_rep 2); head_dim 128 without (MHA) and with GQA.
GQA64 = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2)
MHA128 = dict(hidden_size=512, num_attention_heads=4, num_key_value_heads=4)
GQA128 = dict(hidden_size=512, num_attention_heads=4, num_key_value_heads=2)
SHAPES = {"gqa64": GQA64, "mha128": MHA128, "gqa128": GQA128}
PAD = 5  # left padding of the first sequence


def _left_padding_mask(batch=2, seq=16):
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[0, :PAD] = 0
    return mask


def _attention_refusals(report):
    return [r for r in report.refused if r.family == "attention"]


def _assert_fused_per_layer(reports, train, layers=LAYERS):
    for report in reports:
        assert report.fusions["attention"] == layers, (report.fusions, _attention_refusals(report))
        assert _attention_refusals(report) == []
        assert report.aot_ops["forward"].get("npu_fusion_attention") == layers
        if train:
            assert report.aot_ops["backward"] == {"npu_fusion_attention_grad": layers}


# (attn, shape, padded, train, dtype, dynamic): the forms a Qwen2 model graph shows (SDPA shape 1 with the
# packed-sequence mask and with padding, MHA, the eager chain in train and eval), both head dims, GQA and
# not, fp32 and bf16, train and eval; dynamic=True once on a whole model (repeat_kv under a symbolic S). A
# dynamic compile costs 3x a static one: the backward under symbolic shapes (and the fp32 eager chain) is
# checked on transformers' attention functions alone, below, and the decode test adds a symbolic KV length.
CASES = [
    ("sdpa", "gqa64", False, True, torch.float32, False),
    ("sdpa", "mha128", True, True, torch.float32, False),
    ("sdpa", "gqa128", True, False, torch.bfloat16, False),
    ("eager", "gqa64", True, True, torch.bfloat16, False),
    ("eager", "mha128", False, False, torch.bfloat16, False),
    ("sdpa", "gqa128", False, False, torch.float32, True),
]


def _case_id(case):
    attn, shape, padded, train, dtype, dynamic = case
    return "-".join([attn, shape, "pad" if padded else "nomask", "train" if train else "infer",
                     "fp32" if dtype == torch.float32 else "bf16", "dynamic" if dynamic else "static"])


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_exact_counts_and_parity(npu_ops, case):
    attn, shape, padded, train, dtype, dynamic = case
    model = tiny_qwen2(dtype, attn=attn, intermediate_size=128, **SHAPES[shape]).train(train)
    input_ids = torch.randint(0, 128, (2, 16))
    mask = _left_padding_mask() if padded else None
    # with a mask, run_model compares real tokens only: a left-padded query row is fully masked, where
    # HF's eager chain gives the mean of V and SDPA and the fused kernel 0; real tokens never read it
    reports = assert_parity(model, input_ids, train, dtype, options=ATTN, dynamic=dynamic or None, attention_mask=mask)
    assert len(reports) == 1
    _assert_fused_per_layer(reports, train)


def _hf_attention(impl):
    """transformers' own attention function of ``impl``, on a stand-in module (GQA n_rep 2, training)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.models.qwen2.modeling_qwen2 import eager_attention_forward

    module = types.SimpleNamespace(num_key_value_groups=2, training=True, is_causal=True)

    def attention(q, k, v, keep):
        if impl == "sdpa":
            return sdpa_attention_forward(module, q, k, v, keep, dropout=0.0, scaling=0.125)[0]
        mask = torch.where(keep, torch.zeros((), dtype=q.dtype), torch.finfo(q.dtype).min)  # masking_utils.eager_mask
        return eager_attention_forward(module, q, k, v, mask, scaling=0.125, dropout=0.0)[0]

    return attention


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_hf_attention_functions_with_symbolic_batch_and_length(npu_ops, impl):
    """B and S symbolic, N and D static: what dynamic=True gives in model graphs. One graph, two sizes."""
    attention = _hf_attention(impl)
    compiled = torch.compile(attention, backend="qwen_npu", options=ATTN)
    for batch, seq in ((3, 12), (5, 20)):
        q = torch.randn(batch, 4, seq, 64, requires_grad=True)
        k, v = (torch.randn(batch, 2, seq, 64, requires_grad=True) for _ in range(2))
        keep = torch.ones(batch, 1, seq, seq, dtype=torch.bool).tril() & (torch.rand(batch, 1, seq, seq) > 0.2)
        keep |= torch.eye(seq, dtype=torch.bool)  # no fully masked row (eager would differ there)
        for t in (q, k, v, keep):
            torch._dynamo.mark_dynamic(t, 0)
            torch._dynamo.mark_dynamic(t, 2)
        torch._dynamo.mark_dynamic(keep, 3)
        out = compiled(q, k, v, keep)
        grads = torch.autograd.grad(out.square().sum(), (q, k, v))
        ref = attention(q, k, v, keep)
        ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
        assert relative_l2(out, ref) <= FP32_TOLERANCE["logits"]
        assert relative_l2(dict(enumerate(grads)), dict(enumerate(ref_grads))) <= FP32_TOLERANCE["gradients"]
    (report,) = get_reports()
    assert report.fusions["attention"] == 1 and _attention_refusals(report) == []
    assert report.aot_ops["backward"] == {"npu_fusion_attention_grad": 1}


def test_kv_cache_prefill_then_decode(npu_ops):
    """Batch 1, DynamicCache: prefill, then two decode steps (the second recompiles, KV length symbolic).

    SDPA: prefill is shape 2 (is_causal, enable_gqa), decode attn_mask=None, is_causal=False."""
    model = tiny_qwen2(attn="sdpa", intermediate_size=128, **GQA64).eval()
    prompt = torch.randint(0, 128, (1, 8))

    def generate(runner, steps=3):
        cache, tokens, logits = transformers.DynamicCache(config=model.config), prompt, []
        with torch.no_grad():
            for _ in range(steps):
                out = runner(input_ids=tokens, cache=cache, use_cache=True)
                cache, tokens = out.cache, out.logits[:, -1:].argmax(-1)
                logits.append(out.logits)
        return logits

    eager = generate(model)
    compiled = generate(torch.compile(model, backend="qwen_npu", options=ATTN))
    assert [tuple(t.shape) for t in compiled] == [(1, 8, 128), (1, 1, 128), (1, 1, 128)]
    for got, want in zip(compiled, eager):
        assert relative_l2(got, want) <= FP32_TOLERANCE["logits"]
    reports = get_reports()
    assert len(reports) == 3  # prefill, decode (static), decode (symbolic cache length)
    _assert_fused_per_layer(reports, train=False)


def test_matches_after_rotary_and_uses_copy_free_bsh(npu_ops, tmp_path):
    """q/k as rotary rewrites leave them (npu_rotary_mul(bsnd).transpose) still match; BSH views, no copies."""
    model = tiny_qwen2(attn="sdpa", intermediate_size=128, **GQA64).eval()
    input_ids = torch.randint(0, 128, (2, 16))
    options = {"fusions": "all", "dump_dir": str(tmp_path)}
    (report,) = assert_parity(model, input_ids, False, torch.float32, options=options, use_cache=False)
    assert report.fusions["attention"] == LAYERS and _attention_refusals(report) == []
    rewritten = (tmp_path / report.name / "rewritten.py").read_text()
    assert rewritten.count("npu.npu_fusion_attention.default(") == LAYERS
    assert rewritten.count("'BSH'") == LAYERS  # q, k, v views of linear / npu_rotary_mul outputs: no BNSD copies


# -------------------------------------------------------------------------------------------------
# Dropout: refused for torchair (GE: keep_prob == 1 only) and for the simulated ops (fixed seed);
# fused with keep_prob = 1 - p for real ops with a non-GE downstream.


def _rewrite_with(model_or_fn, args, kwargs, status, downstream):
    """Compile with a backend that only runs ``backend.rewrite`` (no hand-off): (report, rewritten gm, output)."""
    seen = {}

    def capture(gm, example_inputs):
        config = QwenNpuConfig(fusions=frozenset({"attention"}))
        seen["report"], seen["gm"] = backend.rewrite(gm, example_inputs, config, status, downstream)
        return seen["gm"].forward

    # a status that pretends torch_npu is real would have the backend refuse these CPU tensors (an Ascend host's
    # ops take npu tensors only): the rewrite is what is tested here, as if the tensors were on the NPU
    with unittest.mock.patch.object(backend, "_all_on_cpu", lambda _inputs: False):
        out = torch.compile(model_or_fn, backend=capture)(*args, **kwargs)
    return seen["report"], seen["gm"], out


def _fused_calls(gm):
    return [n for n in gm.graph.nodes if n.target is torch.ops.npu.npu_fusion_attention.default]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_dropout_with_torchair_downstream_is_refused(npu_ops, attn):
    model = tiny_qwen2(attn=attn, attention_dropout=0.1).train()
    ids = torch.randint(0, 128, (2, 8))
    report, gm, _ = _rewrite_with(model, (), {"input_ids": ids, "use_cache": False}, npu_ops, "torchair")
    assert report.fusions["attention"] == 0 and _fused_calls(gm) == []
    refusals = _attention_refusals(report)
    assert len(refusals) == LAYERS
    assert all("keep_prob == 1 only" in r.reason and r.source.startswith("modeling_qwen2.py:") for r in refusals)


def test_dropout_with_simulated_ops_is_refused(npu_ops):
    model = tiny_qwen2(attention_dropout=0.1).train()
    ids = torch.randint(0, 128, (2, 8))
    with torch.no_grad():  # training mode (dropout on), no backward graph needed for the decision
        torch.compile(model, backend="qwen_npu", options=ATTN)(input_ids=ids, use_cache=False)
    (report,) = get_reports()
    assert report.fusions["attention"] == 0
    assert [("deterministic" in r.reason) for r in _attention_refusals(report)] == [True] * LAYERS


def test_dropout_with_real_ops_off_ge_fuses_with_keep_prob(npu_ops):
    real = NpuOpsStatus(simulated=False, reason="test: pretend torch_npu is real")
    model = tiny_qwen2(attention_dropout=0.25).train()
    ids = torch.randint(0, 128, (2, 8))
    report, gm, out = _rewrite_with(model, (), {"input_ids": ids, "labels": ids, "use_cache": False}, real, "aot_eager")
    out.loss.backward()
    assert report.fusions["attention"] == LAYERS
    assert [call.args[9] for call in _fused_calls(gm)] == [0.75] * LAYERS  # keep_prob, positional in the schema


def test_dropout_keep_prob_is_statistically_sane(npu_ops):
    """Uniform attention over V = 1: each output is (#kept / Skv) / keep_prob, 1 on average."""
    real = NpuOpsStatus(simulated=False, reason="test: pretend torch_npu is real")

    def attention(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, dropout_p=0.3, scale=0.125)

    q = torch.zeros(2, 4, 64, 16, requires_grad=True)
    k, v = torch.randn(2, 4, 256, 16), torch.ones(2, 4, 256, 16, requires_grad=True)
    report, gm, out = _rewrite_with(attention, (q, k, v), {}, real, "aot_eager")
    assert report.fusions["attention"] == 1 and _fused_calls(gm)[0].args[9] == pytest.approx(0.7)
    assert abs(out.mean().item() - 1.0) < 0.02  # a keep_prob of p instead of 1 - p would give 0.43
    assert out.std().item() > 0.01  # positions were dropped
    out.sum().backward()
    assert torch.isfinite(v.grad).all() and abs(v.grad.mean().item() * 256 / (64 * 1.0) - 1.0) < 0.02


# -------------------------------------------------------------------------------------------------
# Other refusals.


def test_attention_weights_returned_by_eager_are_a_near_miss(npu_ops):
    model = tiny_qwen2(attn="eager").eval()
    ids = torch.randint(0, 128, (1, 8))
    with torch.no_grad():
        compiled = torch.compile(model, backend="qwen_npu", options=ATTN)
        out = compiled(input_ids=ids, output_attentions=True, use_cache=False)
        ref = model(input_ids=ids, output_attentions=True, use_cache=False)
    assert len(out.attentions) == LAYERS
    torch.testing.assert_close(out.attentions[-1], ref.attentions[-1])
    reports = get_reports()
    assert sum(r.fusions["attention"] for r in reports) == 0
    reasons = [r.reason for report in reports for r in _attention_refusals(report)]
    assert len(reasons) == LAYERS and all("also used outside the attention subgraph" in r for r in reasons)


def test_disabled_attention_fuses_nothing(npu_ops):
    model = tiny_qwen2().eval()
    ids = torch.randint(0, 128, (2, 8))
    with torch.no_grad():
        torch.compile(model, backend="qwen_npu", options={"fusions": "rms_norm"})(input_ids=ids, use_cache=False)
    (report,) = get_reports()
    assert "attention" not in report.fusions
    assert "npu_fusion_attention" not in report.aot_ops["forward"]
    assert [("disabled" in r.reason) for r in _attention_refusals(report)] == [True] * LAYERS


def _eager_chain(q, k, v, mask):
    """transformers' eager_attention_forward for n_rep == 1 (fp32: no cast), in eval."""
    weights = torch.matmul(q, k.transpose(2, 3)) * 0.25 + mask
    weights = F.softmax(weights, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(F.dropout(weights, p=0.0, training=False), v)


def test_additive_mask_is_converted_only_when_provably_zero_or_min(npu_ops):
    q, k, v = (torch.randn(2, 4, 8, 16) for _ in range(3))
    keep = torch.rand(2, 1, 8, 8) > 0.3
    keep[..., 0] = True  # no fully masked row

    def built_like_hf(q, k, v, keep):
        return _eager_chain(q, k, v, torch.where(keep, 0.0, torch.finfo(torch.float32).min))

    def soft_bias(q, k, v, keep):
        return _eager_chain(q, k, v, torch.where(keep, 0.0, -1e4))  # exp(-1e4) is 0, but not provably

    mask = torch.where(keep, 0.0, torch.finfo(torch.float32).min)
    for fn, args in ((built_like_hf, (q, k, v, keep)), (soft_bias, (q, k, v, keep)), (_eager_chain, (q, k, v, mask))):
        torch.testing.assert_close(torch.compile(fn, backend="qwen_npu", options=ATTN)(*args), fn(*args))
    fused, bias, graph_input = get_reports()
    assert fused.fusions["attention"] == 1
    assert bias.fusions["attention"] == 0
    assert "values other than 0 and -inf/finfo.min" in _attention_refusals(bias)[0].reason
    assert graph_input.fusions["attention"] == 0 and "a graph input" in _attention_refusals(graph_input)[0].reason


def test_sdpa_default_scale_fuses_and_unbatched_sdpa_is_refused(npu_ops):
    def default_scale(q, k, v):
        return F.scaled_dot_product_attention(q, k, v)  # scale=None: 1/sqrt(D), passed explicitly to the op

    for shape in ((1, 4, 8, 16), (4, 8, 16)):  # the op takes 4-D BNSD/BSND (and 3-D BSH, not [N, S, D])
        q, k, v = (torch.randn(shape) for _ in range(3))
        out = torch.compile(default_scale, backend="qwen_npu", options=ATTN)(q, k, v)
        torch.testing.assert_close(out, default_scale(q, k, v))
    batched, unbatched = get_reports()
    assert batched.fusions["attention"] == 1
    assert unbatched.fusions["attention"] == 0 and "must be 4-D" in _attention_refusals(unbatched)[0].reason


@pytest.mark.parametrize(
    "q, k, v, mask, expected",
    [
        (meta(1, 4, 8, 1024), meta(1, 4, 8, 1024), meta(1, 4, 8, 1024), None, "<= 768"),
        (meta(1, 6, 8, 64), meta(1, 4, 8, 64), meta(1, 4, 8, 64), None, "not a multiple of Nkv=4"),
        (meta(1, 4, 8, 64, dtype=torch.float64),) * 3 + (None, "unsupported dtype torch.float64"),
        (meta(1, 4, 8, 64), meta(1, 4, 8, 64, dtype=torch.bfloat16), meta(1, 4, 8, 64), None, "dtype mismatch"),
        (meta(2, 4, 8, 64),) * 3 + (meta(2, 1, 1, 8, dtype=torch.bool), "none of BNSS/B1SS/11SS/SS"),
        (meta(2, 4, 8, 64),) * 3 + (meta(1, 4, 8, 8, dtype=torch.bool), "none of BNSS/B1SS/11SS/SS"),
        (meta(2, 4, 8, 64), meta(2, 2, 8, 64), meta(2, 2, 8, 64), meta(2, 1, 8, 8, dtype=torch.bool), None),
        (meta(2, 4, 8, 64), meta(2, 2, 8, 64), meta(2, 2, 8, 64), meta(8, 8, dtype=torch.bool), None),
    ],
    ids=["head_dim_1024", "nq_not_multiple_of_nkv", "fp64", "dtype_mismatch", "mask_b11s", "mask_1nss", "b1ss", "ss"],
)
def test_check_attention_contract(q, k, v, mask, expected):
    reason = check_attention(q, k, v, mask)
    assert reason is None if expected is None else expected in reason, reason


def test_check_attention_dropout_depends_on_the_target():
    q = k = v = meta(1, 4, 8, 64)
    assert "keep_prob == 1 only" in check_attention(q, k, v, dropout_p=0.1, target=CompileTarget("torchair", False))
    assert "deterministic" in check_attention(q, k, v, dropout_p=0.1, target=CompileTarget("aot_eager", True))
    assert "no known downstream" in check_attention(q, k, v, dropout_p=0.1, target=None)
    assert check_attention(q, k, v, dropout_p=0.1, target=CompileTarget("aot_eager", False)) is None
    half = meta(1, 4, 8, 64, dtype=torch.bfloat16)
    assert check_attention(half, half, half, dropout_p=0.0, target=CompileTarget("torchair", False)) is None


@pytest.mark.parametrize("downstream,simulated", [("torchair", False), ("torchair", True)])
def test_check_attention_refuses_fp32_for_torchair(downstream, simulated):
    """torchair's GE op FlashAttentionScore takes fp16/bf16 q/k/v only (torch_npu 2.13.0 REG_OP); the aclnn
    kernel behind eager torch_npu (and so aot_eager/inductor on an NPU) takes fp32."""
    q = k = v = meta(1, 4, 8, 64)
    reason = check_attention(q, k, v, target=CompileTarget(downstream, simulated))
    assert "FlashAttentionScore" in reason and "fp16/bf16" in reason, reason
    assert check_attention(q, k, v, target=CompileTarget("aot_eager", simulated)) is None
    for dtype in (torch.float16, torch.bfloat16):
        half = meta(1, 4, 8, 64, dtype=dtype)
        assert check_attention(half, half, half, target=CompileTarget(downstream, simulated)) is None


def test_every_variant_is_registered_once(npu_ops):
    family_pass = get_family_pass("attention")
    family_pass.ensure_registered()
    entries = sum(len(v) for v in family_pass.matcher.patterns.values())
    names = [variant.name for variant in family_pass.variants]
    # none silently dropped as a duplicate: the 32 rows and the 21 varlen variants (their mask input is
    # named packed_mask, so their patterns differ from their rows')
    assert entries == len(names) == len(set(names)) == 32 + len(attention_varlen.VARLEN_ROWS) == 53
    assert all(variant.why for variant in family_pass.variants)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_fp16_fuses_every_family(npu_ops, attn):
    """fp16 has its own eager-attention variant (the softmax cast back bakes in the dtype)."""
    model = tiny_qwen2(torch.float16, attn=attn).eval()
    ids = torch.randint(0, 128, (2, 12))
    with torch.no_grad():
        eager = model(ids).logits.float()
        compiled = torch.compile(model, backend="qwen_npu")(ids).logits.float()
    assert ((compiled - eager).norm() / eager.norm()).item() < 1e-2
    (report,) = get_reports()
    assert report.fusions == {"gated_delta_rule": 0, "rms_norm_gated": 0, "moe": 0, "rms_norm": 5, "swiglu": 2, "rotary": 4, "attention": 2}
    assert [r for r in report.refused if r.family in report.families] == []
