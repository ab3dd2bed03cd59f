"""Rotary (RoPE) fusion -> ``npu_rotary_mul``: exact counts, layout, parity, refusals, ``check_rotary``."""

from __future__ import annotations

import inspect
import re

import pytest
import torch
import transformers
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext
from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb, rotate_half

from qwen_npu_compile import get_reports
from qwen_npu_compile.cli.check.harness import run_model
from qwen_npu_compile.cli.check.models import tiny_qwen2
from qwen_npu_compile.cli.check.parity import FP32_TOLERANCE, relative_l2
from qwen_npu_compile.patterns import expected_fusions
from qwen_npu_compile.patterns.rotary import check_rotary
from tests.helpers.numerics import assert_parity, assert_runs_match, eager_and_reference

LAYERS = 2
ROTARY = {"fusions": "rotary"}
GQA_D64 = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2)
MHA_D128 = dict(hidden_size=512, num_attention_heads=4, num_key_value_heads=4)
#: transformers 5.x calls the KV-cache argument ``cache`` (``past_key_values`` is deprecated there).
_FORWARD_PARAMETERS = inspect.signature(transformers.Qwen2ForCausalLM.forward).parameters
CACHE_KWARG = "cache" if "cache" in _FORWARD_PARAMETERS else "past_key_values"


def left_padding_mask(batch: int, seq: int) -> torch.Tensor:
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[0, : seq // 4] = 0
    return mask


def padded_inputs(batch: int, seq: int) -> dict:
    """A left-padding mask and the position ids generate() derives from it: per-row cos/sin [B, S, D]."""
    mask = left_padding_mask(batch, seq)
    return {"attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)}


def rotary_refusals(report) -> list:
    return [refusal for refusal in report.refused if refusal.family == "rotary"]


def rotary_output_shapes(dump_dir, report) -> list[str]:
    """Shapes of the ``npu_rotary_mul`` outputs (= their x inputs) in the rewritten graph dump."""
    code = (dump_dir / report.name / "rewritten.py").read_text()
    return re.findall(r'"\w+\[([^\]]*)\]" = torch\.ops\.npu\.npu_rotary_mul\.default\(', code)


# -- transformers' Qwen2: counts and parity ----------------------------------------------------------

# Each axis is covered both ways in four compiles: sdpa/eager, left-padding mask/none, train/infer,
# fp32/bf16, GQA/MHA, head_dim 64/128 (dynamic=True and decode have their own tests below).
CASES = [
    pytest.param(GQA_D64, torch.float32, "sdpa", True, True, id="gqa-d64-fp32-sdpa-padded-train"),
    pytest.param(MHA_D128, torch.bfloat16, "eager", False, True, id="mha-d128-bf16-eager-train"),
    pytest.param(GQA_D64, torch.bfloat16, "sdpa", True, False, id="gqa-d64-bf16-sdpa-padded-infer"),
    pytest.param(MHA_D128, torch.float32, "eager", True, False, id="mha-d128-fp32-eager-padded-infer"),
]


@pytest.mark.parametrize("config,dtype,attn,padded,train", CASES)
def test_exact_counts_and_parity(npu_ops, config, dtype, attn, padded, train):
    model = tiny_qwen2(dtype, attn=attn, **config).train(train)
    input_ids = torch.randint(0, 128, (2, 16))
    kwargs = padded_inputs(2, 16) if padded else {}
    [report] = assert_parity(model, input_ids, train, dtype, options=ROTARY, **kwargs)
    assert report.fusions == {"rotary": 2 * LAYERS}
    assert rotary_refusals(report) == []
    assert report.aot_ops["forward"] == {"npu_rotary_mul": 2 * LAYERS}
    if train:
        assert report.aot_ops["backward"] == {"npu_rotary_mul_backward": 2 * LAYERS}
    else:
        assert "backward" not in report.aot_ops


def test_dynamic_shapes_one_graph_with_backward(npu_ops):
    """dynamic=True: symbolic B and S; the size limits are guarded, not specialised (no recompile).
    One layer: a dynamic training compile costs ~10 s per layer here."""
    dtype, layers = torch.float32, 1
    model = tiny_qwen2(dtype, attn="sdpa", num_hidden_layers=layers, **GQA_D64).train()
    compiled = torch.compile(model, backend="qwen_npu", options=ROTARY, dynamic=True)
    for batch, seq in ((2, 16), (3, 11)):
        input_ids = torch.randint(0, 128, (batch, seq))
        kwargs = padded_inputs(batch, seq)
        eager, reference = eager_and_reference(model, input_ids, True, dtype, **kwargs)
        assert_runs_match(run_model(model, compiled, input_ids, True, **kwargs), eager, reference)
    [report] = get_reports()
    assert report.fusions == {"rotary": 2 * layers}
    assert report.aot_ops == {
        "forward": {"npu_rotary_mul": 2 * layers}, "backward": {"npu_rotary_mul_backward": 2 * layers}}


def test_prefill_and_decode_with_dynamic_cache_fuse_in_bsnd(npu_ops, tmp_path):
    """Batch 1, one decode step (S=1) with a DynamicCache: 16 query heads make B*N = 16 > 8*S, which the
    BNSD kernel rejects (error 561002); the fusion must run on the BSND tensor instead."""
    config = dict(hidden_size=1024, num_attention_heads=16, num_key_value_heads=2, use_cache=True)  # D = 64
    model = tiny_qwen2(torch.float32, attn="sdpa", **config).eval()
    prompt, next_token = torch.randint(0, 128, (1, 8)), torch.randint(0, 128, (1, 1))

    def prefill_and_decode(runner):
        cache = transformers.DynamicCache(config=model.config)
        with torch.no_grad():
            prefill = runner(input_ids=prompt, use_cache=True, **{CACHE_KWARG: cache}).logits
            decode = runner(input_ids=next_token, use_cache=True, **{CACHE_KWARG: cache}).logits
        assert cache.get_seq_length() == 9
        return prefill, decode

    expected = prefill_and_decode(model)
    compiled = torch.compile(model, backend="qwen_npu", options={**ROTARY, "dump_dir": str(tmp_path)})
    got = prefill_and_decode(compiled)
    for actual, reference in zip(got, expected):
        assert relative_l2(actual, reference) <= FP32_TOLERANCE["logits"]

    prefill_report, decode_report = get_reports()
    assert [r.fusions for r in (prefill_report, decode_report)] == [{"rotary": 2 * LAYERS}] * 2
    assert rotary_refusals(decode_report) == []
    # x of every fused call is [B, S, N, D] = [1, 1, 16 | 2, 64], not BNSD [1, 16 | 2, 1, 64]
    assert sorted(rotary_output_shapes(tmp_path, decode_report)) == sorted(["1, 1, 16, 64", "1, 1, 2, 64"] * LAYERS)
    # ... where the BNSD layout would have been refused
    q_bnsd, r = torch.empty(1, 16, 1, 64, device="meta"), torch.empty(1, 1, 1, 64, device="meta")
    assert "561002" in check_rotary(q_bnsd, r, r, "BNSD")


def test_disabled_by_option(npu_ops):
    model = tiny_qwen2(torch.float32, **GQA_D64).eval()
    [report] = assert_parity(model, torch.randint(0, 128, (2, 16)), False, torch.float32,
                             options={"fusions": "rms_norm,swiglu"})
    assert report.fusions == {"rms_norm": 2 * LAYERS + 1, "swiglu": LAYERS}
    assert "npu_rotary_mul" not in report.aot_ops["forward"]
    refusals = rotary_refusals(report)
    assert len(refusals) == 2 * LAYERS and all("disabled" in r.reason for r in refusals)


# -- small modules: the BNSD variant and the refusals ------------------------------------------------


class QKRotary(torch.nn.Module):
    """q/k projections + HF ``apply_rotary_pos_emb``, as in Qwen2Attention (BNSD views of BSND memory).

    ``reuse_rotated_q`` also returns ``rotate_half(q)``; ``fused_qkv`` slices q and k out of one qkv
    projection (their ``[B, S, N, D]`` views are then strided, not contiguous).
    """

    def __init__(self, heads=2, head_dim=64, reuse_rotated_q=False, fused_qkv=False):
        super().__init__()
        self.head_dim, self.reuse_rotated_q, self.fused_qkv = head_dim, reuse_rotated_q, fused_qkv
        hidden = heads * head_dim
        if fused_qkv:
            self.qkv_proj = torch.nn.Linear(hidden, 3 * hidden)
        else:
            self.q_proj, self.k_proj = torch.nn.Linear(hidden, hidden), torch.nn.Linear(hidden, hidden)

    def forward(self, h, cos, sin):
        batch, seq, hidden = h.shape
        if self.fused_qkv:
            q, k, _ = self.qkv_proj(h).split(hidden, dim=-1)
        else:
            q, k = self.q_proj(h), self.k_proj(h)
        q = q.view(batch, seq, -1, self.head_dim).transpose(1, 2)
        k = k.view(batch, seq, -1, self.head_dim).transpose(1, 2)
        if not self.reuse_rotated_q:
            return apply_rotary_pos_emb(q, k, cos, sin)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        rotated_q = rotate_half(q)
        return q * cos + rotated_q * sin, k * cos + rotate_half(k) * sin, rotated_q


def cos_sin(batch, seq, head_dim, dtype=torch.float32):
    """Random cos/sin ``[batch, seq, head_dim]`` with HF's structure (``cat((freqs, freqs), -1)``)."""
    angles = torch.randn(batch, seq, head_dim // 2).repeat(1, 1, 2)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def compile_and_compare(fn, *args, options=ROTARY, atol=1e-6):
    expected = fn(*args)
    got = torch.compile(fn, backend="qwen_npu", options=options)(*args)
    for actual, reference in zip(got, expected):
        torch.testing.assert_close(actual, reference, atol=atol, rtol=atol)
    [report] = get_reports()
    return report


def test_rotated_intermediate_used_elsewhere_is_not_fused(npu_ops):
    module = QKRotary(reuse_rotated_q=True)
    report = compile_and_compare(module, torch.randn(2, 8, 128), *cos_sin(1, 8, 64))
    assert report.fusions == {"rotary": 1}  # k only
    [refusal] = rotary_refusals(report)
    assert "near miss" in refusal.reason and "also used outside" in refusal.reason


def test_cos_sin_dtype_mismatch_fuses_in_the_promoted_dtype(npu_ops):
    """bf16 q/k with fp32 cos/sin (autocast's linear, fp32 rotary embedding): HF promotes the products
    to fp32; the rewrite casts q/k to fp32 first, so the kernel computes exactly that, fp32 out."""
    module = QKRotary().to(torch.bfloat16)
    report = compile_and_compare(module, torch.randn(2, 8, 128, dtype=torch.bfloat16), *cos_sin(1, 8, 64))
    assert report.fusions == {"rotary": 2}
    assert rotary_refusals(report) == []


def test_non_contiguous_bsnd_tensor_is_refused(npu_ops):
    """q/k sliced out of a fused qkv projection: the [B, S, N, D] view has row stride 3H."""
    module = QKRotary(fused_qkv=True)
    report = compile_and_compare(module, torch.randn(2, 8, 128), *cos_sin(2, 8, 64))
    assert report.fusions == {"rotary": 0}
    refusals = rotary_refusals(report)
    assert len(refusals) == 2 and all("x is not contiguous" in r.reason for r in refusals)


def head_first_rotary(x, cos, sin):
    """x already contiguous BNSD (not a transposed view), which no transformers model computes."""
    return (x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1),)


def test_contiguous_bnsd_input_is_a_near_miss(npu_ops):
    """No variant for a contiguous BNSD x (none of the supported models has one; see
    tests/patterns/test_every_variant.py): left unfused, reported as a near miss, results unchanged."""
    x = torch.randn(2, 4, 8, 64, requires_grad=True)
    cos, sin = cos_sin(2, 8, 64)
    (expected,), (got,) = head_first_rotary(x, cos, sin), torch.compile(
        head_first_rotary, backend="qwen_npu", options=ROTARY)(x, cos, sin)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)
    [report] = get_reports()
    assert report.fusions == {"rotary": 0}
    refusals = rotary_refusals(report)
    assert len(refusals) == 1 and refusals[0].reason.startswith("near miss:"), refusals


def bsnd_rotary(x_bsnd, cos, sin):
    x = x_bsnd.transpose(1, 2)
    return (x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1),)


@pytest.mark.parametrize("cos_needs_grad", [True, False], ids=["cos-grad", "cos-no-grad"])
def test_bn_over_1024_is_refused_only_when_cos_sin_need_grad(npu_ops, cos_needs_grad):
    """B*N = 64*32 = 2048: allowed unless r1/r2 need grad (read from the graph, not the detached val)."""
    x = torch.randn(64, 2, 32, 64, requires_grad=True)
    cos, sin = (t.requires_grad_(cos_needs_grad) for t in cos_sin(64, 2, 64))
    report = compile_and_compare(bsnd_rotary, x, cos, sin, atol=1e-5)
    if cos_needs_grad:
        assert report.fusions == {"rotary": 0}
        assert [r.reason for r in rotary_refusals(report)] == ["B*N=2048 > 1024 while r1/r2 need grad"]
    else:
        assert report.fusions == {"rotary": 1} and rotary_refusals(report) == []


# -- check_rotary as a pure function (meta tensors) --------------------------------------------------


def meta(*shape, dtype=torch.float32, grad=False):
    return torch.empty(shape, dtype=dtype, device="meta", requires_grad=grad)


@pytest.mark.parametrize("x_shape,r_shape,layout,r_grad,expected", [
    pytest.param((2, 16, 4, 64), (1, 16, 1, 64), "BSND", False, None, id="bsnd-1S1D"),
    pytest.param((2, 16, 4, 128), (2, 16, 1, 128), "BSND", True, None, id="bsnd-BS1D-grad"),
    pytest.param((2, 4, 16, 64), (1, 1, 16, 64), "BNSD", False, None, id="bnsd-11SD"),
    pytest.param((1, 1, 16, 64), (1, 1, 1, 64), "BSND", False, None, id="bsnd-decode"),
    pytest.param((64, 2, 32, 64), (64, 2, 1, 64), "BSND", True, "B*N=2048 > 1024 while r1/r2 need grad",
                 id="bn-over-1024-with-grad"),
    pytest.param((64, 2, 32, 64), (64, 2, 1, 64), "BSND", False, None, id="bn-over-1024-no-grad"),
    pytest.param((2, 16, 4, 63), (1, 16, 1, 63), "BSND", False, "D=63 must be even", id="d-odd"),
    pytest.param((2, 16, 4, 896), (1, 16, 1, 896), "BSND", False, "D=896 must be even and < 896", id="d-896"),
    pytest.param((1, 2, 1000, 64), (1, 2, 1, 64), "BSND", False, "N=1000 must both be < 1000", id="n-1000"),
    pytest.param((1000, 2, 4, 64), (1, 2, 1, 64), "BSND", False, "B=1000 and N=4", id="b-1000"),
    pytest.param((1, 16, 1, 64), (1, 1, 1, 64), "BNSD", False, "error 561002", id="bnsd-decode"),
    pytest.param((2, 16, 4, 64), (1, 1, 16, 64), "BSND", False, "does not broadcast to x", id="r-in-bnsd-shape"),
    pytest.param((2, 16, 4, 64), (1, 16, 4, 64), "BSND", False, "not a shape npu_rotary_mul accepts", id="r-1SND"),
])
def test_check_rotary_limits(x_shape, r_shape, layout, r_grad, expected):
    x, r1, r2 = meta(*x_shape, dtype=torch.bfloat16), meta(*r_shape, dtype=torch.bfloat16, grad=r_grad), meta(
        *r_shape, dtype=torch.bfloat16)
    reason = check_rotary(x, r1, r2, layout)
    if expected is None:
        assert reason is None
    else:
        assert reason is not None and expected in reason, reason


def test_check_rotary_dtypes_rank_and_strides():
    x, r = meta(2, 16, 4, 64, dtype=torch.bfloat16), meta(1, 16, 1, 64, dtype=torch.bfloat16)
    assert "dtype mismatch" in check_rotary(x, meta(1, 16, 1, 64), r, "BSND")
    assert "unsupported dtype torch.float64" in check_rotary(*(t.double() for t in (x, r, r)), "BSND")
    assert "must be 4-D" in check_rotary(x[0], r[0], r[0], "BSND")
    transposed = meta(2, 4, 16, 64, dtype=torch.bfloat16).transpose(1, 2)
    assert "x is not contiguous" in check_rotary(transposed, r, r, "BSND")
    strided_r = meta(1, 16, 1, 128, dtype=torch.bfloat16)[..., :64]
    assert "cos is not contiguous" in check_rotary(x, strided_r, r, "BSND")
    assert "not a tensor" in check_rotary(x, None, r, "BSND")


def test_check_rotary_symbolic_sizes_guard_instead_of_specialising():
    """Under dynamic=True B and S are symbols: the limits become guards (B < 1000), not B == 2."""
    shape_env = ShapeEnv()
    mode = FakeTensorMode(shape_env=shape_env)
    context = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.DYNAMIC] + [DimDynamic.STATIC] * 2)
    x = mode.from_tensor(torch.empty(2, 16, 4, 64), symbolic_context=context)
    with mode:
        r = torch.empty(1, x.shape[1], 1, 64)
    assert check_rotary(x, r, r, "BSND") is None
    guards = [str(guard.expr) for guard in shape_env.guards]
    assert any("< 1000" in guard for guard in guards), guards
    assert x.shape[0].node.expr not in shape_env.replacements, "B was specialised"
    assert x.shape[1].node.expr not in shape_env.replacements, "S was specialised"
    big = mode.from_tensor(torch.empty(1200, 16, 4, 64), symbolic_context=context)
    assert "B=1200" in check_rotary(big, r, r, "BSND")


def test_stand_in_backward_outputs_have_the_fake_kernels_layout(npu_ops):
    """The grad reaching npu_rotary_mul_backward from the BSND rewrite is a transposed view; the CPU
    stand-in must still return dx laid out like its fake (empty_like(x)), or AOT's view of dx fails."""
    x, r = torch.randn(2, 8, 4, 64), torch.randn(1, 8, 1, 64)
    grad = torch.randn(2, 4, 8, 64).transpose(1, 2)
    dx, dr1, dr2 = torch.ops.npu.npu_rotary_mul_backward.default(grad, x, r, r)
    assert dx.stride() == x.stride() and dr1.stride() == r.stride() and dr2.stride() == r.stride()


# -- partial_rotary_factor 1.0 (Qwen3.5 with the whole head rotated) ---------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_full_width_partial_rotary_fuses_as_the_full_rotary(npu_ops, dtype):
    """Qwen3.5's partial rotary at ``partial_rotary_factor`` 1.0 (``q[..., :D]`` traces as ``aten.alias``, the
    pass-through as an empty slice, then a cat): fused as the full rotary, forward and backward, exact counts, no
    near miss, eager's values and gradients."""
    qwen3_5 = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5", reason="transformers >= 5")

    def rope(q_bsnd, k_bsnd, cos, sin):
        return qwen3_5.apply_rotary_pos_emb(q_bsnd.transpose(1, 2), k_bsnd.transpose(1, 2), cos, sin)

    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, 4, 64, generator=generator).to(dtype).requires_grad_(True)
    k = torch.randn(2, 8, 2, 64, generator=generator).to(dtype).requires_grad_(True)
    angles = torch.randn(2, 8, 32, generator=generator).repeat(1, 1, 2)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)

    def run(fn):
        inputs = [t.detach().clone().requires_grad_(t.requires_grad) for t in (q, k, cos, sin)]
        outs = fn(*inputs)
        sum((o.float() * torch.linspace(-1, 1, o.numel()).view(o.shape)).sum() for o in outs).backward()
        return [*outs, inputs[0].grad, inputs[1].grad]

    compiled, eager = run(torch.compile(rope, backend="qwen_npu")), run(rope)
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1.6e-2)
    for got, want in zip(compiled, eager):
        torch.testing.assert_close(got, want, **tolerance)
    [report] = get_reports()
    assert report.fusions["rotary"] == 2 and report.variants == {"rotary_bsnd": 2}
    assert rotary_refusals(report) == []
    assert report.aot_ops["forward"] == {"npu_rotary_mul": 2}
    assert report.aot_ops["backward"] == {"npu_rotary_mul_backward": 2}


def test_expected_fusions_reads_a_multimodal_models_text_config():
    """``Qwen3_5ForConditionalGeneration``'s top-level ``Qwen3_5Config`` (what real checkpoints are): its
    ``text_config``'s counts, not ``AttributeError``."""
    import transformers

    if not hasattr(transformers, "Qwen3_5Config"):
        pytest.skip(f"transformers {transformers.__version__} has no Qwen3.5")
    config = transformers.Qwen3_5Config(text_config=dict(num_hidden_layers=8))
    assert expected_fusions(config) == expected_fusions(config.text_config)
    assert expected_fusions(config, ["rotary", "gated_delta_rule"]) == {"gated_delta_rule": 6, "rotary": 4}
    assert expected_fusions(config, per_layer=True, layer_type="full_attention")["rotary"] == 2
