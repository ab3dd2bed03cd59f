"""Variants of a training step people run: tensor-valued scalars, autocast, odd attention spellings, left padding,
gradient checkpointing.

A tiny Qwen2 with uneven widths: hidden 96, 2 layers, 6 heads, 2 KV heads (GQA), vocab 256, batch 2, seq 12,
transformers' real modeling code, one training step; exact fusion counts, parity with eager, refusal
reasons.
"""

from __future__ import annotations

import logging
import types

import pytest
import torch
import transformers

from qwen_npu_compile.cli.check.harness import run_model
from qwen_npu_compile.cli.check.models import tiny_qwen2
from qwen_npu_compile.cli.check.parity import FP32_TOLERANCE, relative_l2
from qwen_npu_compile.report import SUMMARY
from tests.helpers.models import token_ids
from tests.helpers.numerics import assert_runs_match, eager_and_reference

ISSUE = dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=2, vocab_size=256)
LAYERS = 2
#: what a dense Qwen2 of LAYERS layers fuses: the families it has nothing of at 0
DENSE_FUSIONS = dict(gated_delta_rule=0, rms_norm_gated=0, moe=0, rms_norm=2 * LAYERS + 1, swiglu=LAYERS, rotary=2 * LAYERS,
                     attention=LAYERS)
BATCH, SEQ = 2, 12


def _train_parity(model, options=None, dtype=torch.float32, **kwargs):
    """One training step eager and compiled on the same tokens; returns the graph reports."""
    ids = token_ids(model.config.vocab_size)
    eager, reference = eager_and_reference(model, ids, True, dtype, **kwargs)
    compiled = torch.compile(model, backend="qwen_npu", options=options or {})
    assert_runs_match(run_model(model, compiled, ids, True, **kwargs), eager, reference)
    return list(SUMMARY.graphs)


def _totals(reports):
    totals = {}
    for report in reports:
        for family, count in report.fusions.items():
            totals[family] = totals.get(family, 0) + count
    return totals


def _reasons(reports, family):
    return [r.reason for report in reports for r in report.refused if r.family == family]


# --------------------------------------------------------------------------------------------------
# Item 3: tensors where a fused op's schema wants a Python scalar.
# --------------------------------------------------------------------------------------------------


def _constant_property(module, name, value):
    """Make ``module.<name>`` a ``torch.tensor(value)`` created in every forward: a graph constant."""
    cls = type(module)
    module.__class__ = type(f"Constant{cls.__name__}", (cls,), {name: property(lambda self: torch.tensor(value))})


@pytest.mark.parametrize("kind", ["python", "constant_0d", "input_0d", "per_head"])
def test_attention_scale_kinds(kind):
    """Eager attention's ``self.scaling``: a float or a constant 0-d tensor fuses; a 0-d module attribute
    (a graph input) and a per-head ``[1, N, 1, 1]`` tensor are refused with the reason; none crashes."""
    model = tiny_qwen2(attn="eager", **ISSUE)
    heads = ISSUE["num_attention_heads"]
    for layer in model.model.layers:
        scaling = layer.self_attn.scaling
        if kind == "constant_0d":
            _constant_property(layer.self_attn, "scaling", scaling)
        elif kind == "input_0d":
            layer.self_attn.scaling = torch.tensor(scaling)
        elif kind == "per_head":
            layer.self_attn.scaling = scaling * torch.linspace(0.5, 1.5, heads).view(1, heads, 1, 1)
    reports = _train_parity(model, {"fusions": "attention"})
    reasons = _reasons(reports, "attention")
    if kind in ("python", "constant_0d"):
        assert _totals(reports)["attention"] == LAYERS and reasons == []
    elif kind == "input_0d":
        assert _totals(reports)["attention"] == 0
        assert reasons == [
            "scale is a torch.float32 tensor of shape (), a graph input (a module attribute, buffer or argument): "
            "not a compile-time constant, so it cannot become npu_fusion_attention's Python float scale (set it "
            "to a Python float)"
        ] * LAYERS
    else:
        assert _totals(reports)["attention"] == 0
        assert reasons == [
            f"scale is a torch.float32 tensor of shape (1, {heads}, 1, 1) (e.g. a per-head scale), but "
            "npu_fusion_attention takes one Python float scale for all heads and positions"
        ] * LAYERS


@pytest.mark.parametrize("kind", ["constant_0d", "input_0d"])
def test_rms_norm_tensor_epsilon(kind):
    """Qwen2RMSNorm's ``variance_epsilon`` as a tensor: read when constant (2L+1 fused), else refused."""
    model = tiny_qwen2(**ISSUE)
    norms = [m for m in model.modules() if isinstance(m, transformers.models.qwen2.modeling_qwen2.Qwen2RMSNorm)]
    assert len(norms) == 2 * LAYERS + 1
    for norm in norms:
        if kind == "constant_0d":
            _constant_property(norm, "variance_epsilon", norm.variance_epsilon)
        else:
            norm.variance_epsilon = torch.tensor(norm.variance_epsilon)
    reports = _train_parity(model, {"fusions": "rms_norm"})
    if kind == "constant_0d":
        assert _totals(reports)["rms_norm"] == 2 * LAYERS + 1 and _reasons(reports, "rms_norm") == []
    else:
        assert _totals(reports)["rms_norm"] == 0
        assert _reasons(reports, "rms_norm") == [
            "epsilon is a torch.float32 tensor of shape (), a graph input (a module attribute, buffer or "
            "argument): not a compile-time constant, so it cannot become npu_rms_norm's Python float epsilon "
            "(set it to a Python float)"
        ] * (2 * LAYERS + 1)


# --------------------------------------------------------------------------------------------------
# Item 2: fp32 weights under torch.autocast(bf16).
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_autocast_bf16_fuses_every_family(attn):
    """fp32 weights under ``torch.autocast("cpu", bf16)``: rotary (bf16 q/k, fp32 cos/sin) and attention
    (fp32 q/k, bf16 v) fuse with the casts autocast implies; 5/2/4/2 and the fp32-reference bound."""
    model = tiny_qwen2(attn=attn, **ISSUE)
    ids = token_ids(256)
    fp32 = run_model(model, model, ids, True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        eager = run_model(model, model, ids, True)
        compiled = run_model(model, torch.compile(model, backend="qwen_npu"), ids, True)
    reports = list(SUMMARY.graphs)
    assert _totals(reports) == DENSE_FUSIONS
    assert [r.reason for report in reports for r in report.refused] == []
    assert compiled[0].dtype == eager[0].dtype
    assert_runs_match(compiled, eager, fp32)  # half precision: judged against the fp32 run
    backward = {op: n for report in reports for op, n in report.aot_ops["backward"].items()}
    assert backward.get("npu_fusion_attention_grad") == LAYERS


# --------------------------------------------------------------------------------------------------
# Item 5: other spellings of the key transpose in hand-written eager attention.
# --------------------------------------------------------------------------------------------------


class HandWrittenAttention(torch.nn.Module):
    """A non-HF attention: one qkv projection, ``q @ <key transposed> * scale`` in the given spelling, a
    causal ``where(bool, 0, finfo.min)`` mask, fp32 softmax, dropout, ``@ v``. 4 heads of 16."""

    def __init__(self, spelling: str):
        super().__init__()
        self.spelling = spelling
        self.qkv = torch.nn.Linear(64, 192)

    def forward(self, x):
        batch, seq, _ = x.shape
        q, k, v = self.qkv(x).view(batch, seq, 3, 4, 16).unbind(2)  # [B, S, N, D] each
        q, v = q.transpose(1, 2), v.transpose(1, 2)
        if self.spelling == "bsnd_permute":  # the key stays BSND: [B, S, N, D] -> [B, N, D, S] in one permute
            kt = k.permute(0, 2, 3, 1)
        else:
            k = k.transpose(1, 2)
            kt = {"neg": lambda: k.transpose(-2, -1), "swapped": lambda: k.transpose(3, 2),
                  "permute": lambda: k.permute(0, 1, 3, 2)}[self.spelling]()  # fmt: skip
        scores = q @ kt * 0.25
        causal = torch.ones(seq, seq, dtype=torch.bool, device=x.device).tril()
        scores = scores + torch.where(causal, 0.0, torch.finfo(torch.float32).min)
        probs = torch.nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        probs = torch.nn.functional.dropout(probs, p=0.0, training=self.training)
        return (probs @ v).transpose(1, 2).reshape(batch, seq, 64)


@pytest.mark.parametrize("spelling", ["neg", "swapped", "permute", "bsnd_permute"])
def test_key_transpose_spellings(spelling):
    """``q @ key.transpose(-2, -1)`` and the other spellings of the same swap fuse (respelled as HF's
    ``transpose(2, 3)``); a key transposed from another layout is refused naming that spelling."""
    torch.manual_seed(0)
    module = HandWrittenAttention(spelling)
    x = torch.randn(2, SEQ, 64, requires_grad=True)
    expected = module(x)
    (expected_grad,) = torch.autograd.grad(expected.square().sum(), x)
    got = torch.compile(module, backend="qwen_npu", options={"fusions": "attention"})(x)
    (got_grad,) = torch.autograd.grad(got.square().sum(), x)
    assert relative_l2(got, expected) <= FP32_TOLERANCE["logits"] and relative_l2(got_grad, expected_grad) <= FP32_TOLERANCE["gradients"]
    [report] = SUMMARY.graphs
    if spelling == "bsnd_permute":
        assert report.fusions == {"attention": 0}
        [reason] = _reasons([report], "attention")
        assert reason.startswith("near miss: aten.softmax.int at test_training_variants.py:")
        assert reason.endswith(
            "is not inside a complete attention subgraph: the key operand of matmul matmul is "
            "aten.permute.default([0, 2, 3, 1],), not a [B, N, S, D] key's transpose(2, 3) (the spelling the "
            "variants match; other spellings of that swap are respelled)"
        ), reason
    else:
        assert report.fusions == {"attention": 1} and _reasons([report], "attention") == []


# --------------------------------------------------------------------------------------------------
# check --autocast / --grad-checkpointing on a local tiny config (Qwen3: 4 RMSNorms per layer).
# --------------------------------------------------------------------------------------------------


def _tiny_dir(tmp_path, family="qwen3"):
    config = transformers.Qwen3Config(hidden_size=96, intermediate_size=192, num_hidden_layers=LAYERS,
                                      num_attention_heads=6, num_key_value_heads=2, head_dim=16, vocab_size=256)  # fmt: skip
    config.save_pretrained(tmp_path / f"tiny-{family}")
    return tmp_path / f"tiny-{family}"


def test_check_autocast_on_qwen3(npu_ops, tmp_path, capsys):
    import json

    from qwen_npu_compile import cli

    out = tmp_path / "result.json"
    status = cli.main(["check", str(_tiny_dir(tmp_path)), "--seq-len", str(SEQ), "--batch", str(BATCH), "--autocast",
                       "--attn", "eager", "--json", str(out)])  # fmt: skip
    result = json.loads(out.read_text())
    assert status == 0, capsys.readouterr().out
    assert result["settings"]["autocast"] is True and result["settings"]["grad_checkpointing"] is False
    assert {f: row["fused"] for f, row in result["fusions"].items()} == {
        "gated_delta_rule": 0, "rms_norm_gated": 0, "moe": 0, "rms_norm": 4 * LAYERS + 1, "swiglu": LAYERS, "rotary": 2 * LAYERS, "attention": LAYERS}
    assert cli.main(["check", str(_tiny_dir(tmp_path)), "--autocast", "--dtype", "fp32"]) == 2


# --------------------------------------------------------------------------------------------------
# Item 4: eager attention with left padding: fully masked rows computed as eager computes them.
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_eager_left_padding_matches_eager_on_every_row(dtype):
    """3 leading pads in row 0, labels -100 on the pads (HF shifts them, so the last pad's logits still
    predict the first real token): every logit row, padded ones included, and every gradient match eager
    (fp32: rel-L2 <= 1e-5 logits, <= 1e-4 gradients; bf16: the fp32-reference bound)."""
    model = tiny_qwen2(dtype=dtype, attn="eager", **ISSUE)
    ids = token_ids(256)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[0, :3] = 0
    labels = ids.masked_fill(mask == 0, -100)

    def run(module, runner):
        module.zero_grad(set_to_none=True)
        out = runner(input_ids=ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        return out.logits.detach().float(), {n: p.grad.float().clone() for n, p in module.named_parameters()}

    eager = run(model, model)
    compiled = run(model, torch.compile(model, backend="qwen_npu"))
    reports = list(SUMMARY.graphs)
    assert _totals(reports) == DENSE_FUSIONS
    reference = None
    if dtype != torch.float32:
        reference = tiny_qwen2(dtype=torch.float32, attn="eager", **ISSUE)
        reference.load_state_dict({n: p.float() for n, p in model.state_dict().items()})
        reference = run(reference, reference)
    assert_runs_match(compiled, eager, reference)


# --------------------------------------------------------------------------------------------------
# Item 1: whole-model compile with non-reentrant gradient checkpointing (HF Trainer's torch_compile=True
# with gradient_checkpointing=True).
# --------------------------------------------------------------------------------------------------


def _checkpointed(attn="sdpa", dtype=torch.float32):
    model = tiny_qwen2(dtype=dtype, attn=attn, **ISSUE)
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


#: One forward of each checkpointed decoder layer is recomputed in the backward: its fused forward ops
#: appear in the AOT backward graph once per layer (RMSNorm 2, rotary 2, SwiGLU 1 per layer).
RECOMPUTED = {"npu_rms_norm": 2 * LAYERS, "npu_rotary_mul": 2 * LAYERS, "npu_swiglu": LAYERS}

#: torch 2.7's pre-dispatch tracer inlines checkpointed regions; the backend then compiles unfused.
INLINES_REGIONS = tuple(int(part) for part in torch.__version__.split(".")[:2]) < (2, 9)
INLINED = "the pre-dispatch retrace inlined 2 activation-checkpointed region(s)"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_whole_model_gradient_checkpointing_fuses_inside_the_regions(dtype, caplog):
    """Each checkpointed decoder layer is a ``tag_activation_checkpoint`` region: its body is
    canonicalized and fused like the top-level graph, the backward recomputes the fused ops, and one
    training step matches eager (fp32 bounds; bf16: the fp32-reference bound)."""
    model = _checkpointed(dtype=dtype)
    with caplog.at_level(logging.WARNING, logger="qwen_npu_compile"):
        [report] = _train_parity(model, dtype=dtype)
    if INLINES_REGIONS:
        assert report.fallback.startswith(INLINED), report.fallback
        assert report.fusions == dict.fromkeys(report.families, 0)
        assert len([r for r in caplog.records if r.name.startswith("qwen_npu_compile")]) == 1
        return
    assert report.fallback is None
    assert report.fusions == DENSE_FUSIONS
    assert report.refused == []
    backward = report.aot_ops["backward"]
    assert {op: backward.get(op, 0) for op in RECOMPUTED} == RECOMPUTED
    assert backward["npu_fusion_attention_grad"] == LAYERS
    assert [r for r in caplog.records if r.name.startswith("qwen_npu_compile")] == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_whole_model_gradient_checkpointing_eager_attention_fuses(dtype):
    """Eager attention inside a checkpointed region reads its float mask as an input of the region's
    body: the proof that it holds only 0/finfo.min follows the input to the ``where`` that builds it in
    the calling graph (transformers' eager_mask), so attention fuses in every region, the backward
    recomputes the fused ops, and training matches eager."""
    reports = _train_parity(_checkpointed(attn="eager", dtype=dtype), dtype=dtype)
    if INLINES_REGIONS:
        assert [r.fallback.startswith(INLINED) for r in reports] == [True]
        return
    assert _totals(reports) == DENSE_FUSIONS
    assert _reasons(reports, "attention") == []
    [report] = reports
    backward = report.aot_ops["backward"]
    assert {op: backward.get(op, 0) for op in RECOMPUTED} == RECOMPUTED
    assert backward["npu_fusion_attention_grad"] == LAYERS


def test_region_mask_that_is_a_graph_input_is_refused(npu_ops):
    """The proof follows a region input only to what its caller passes: a float mask that is an input of
    the whole graph (here: of a checkpointed function compiled alone) still cannot be proven 0/finfo.min."""
    from torch.utils.checkpoint import checkpoint
    from transformers.models.qwen2.modeling_qwen2 import eager_attention_forward

    module = types.SimpleNamespace(num_key_value_groups=2, training=False)

    def attention(q, k, v, mask):
        return checkpoint(
            lambda q, k, v, mask: eager_attention_forward(module, q, k, v, mask, scaling=0.125)[0],
            q, k, v, mask, use_reentrant=False,
        )  # fmt: skip

    q = torch.randn(2, 4, 8, 64, requires_grad=True)
    k, v = (torch.randn(2, 2, 8, 64, requires_grad=True) for _ in range(2))
    mask = torch.zeros(2, 1, 8, 8).masked_fill(torch.ones(8, 8, dtype=torch.bool).triu(1), torch.finfo(torch.float32).min)
    out = torch.compile(attention, backend="qwen_npu")(q, k, v, mask)
    torch.testing.assert_close(out, attention(q, k, v, mask))
    [report] = SUMMARY.graphs
    if INLINES_REGIONS:
        assert report.fallback.startswith("the pre-dispatch retrace inlined 1 activation-checkpointed region")
        return
    assert report.fusions["attention"] == 0
    [reason] = [r.reason for r in report.refused if r.family == "attention"]
    assert reason.startswith("additive float mask comes from a graph input"), reason


@pytest.mark.skipif(INLINES_REGIONS, reason="torch 2.7 inlines checkpointed regions (compiled unfused)")
def test_whole_model_gradient_checkpointing_dynamic_shapes():
    """``dynamic=True``: floats such as RMSNorm's eps enter each region as 0-d tensor inputs read with
    ``.item()``; the region bodies are retraced with the graph's own values for them, so everything
    fuses (5/2/4/2), the backward recomputes the fused ops, and training matches eager (fp32)."""
    model = _checkpointed()
    ids = token_ids(256)
    eager = run_model(model, model, ids, True)
    compiled = run_model(model, torch.compile(model, backend="qwen_npu", dynamic=True), ids, True)
    assert_runs_match(compiled, eager)
    [report] = SUMMARY.graphs
    assert report.fallback is None
    assert report.fusions == DENSE_FUSIONS
    backward = report.aot_ops["backward"]
    assert {op: backward.get(op, 0) for op in RECOMPUTED} == RECOMPUTED


@pytest.mark.skipif(INLINES_REGIONS, reason="torch 2.7 inlines checkpointed regions (compiled unfused)")
def test_whole_model_selective_checkpointing_policy_sees_the_fused_ops():
    """A user's selective-checkpointing policy (``context_fn``) stays with each region and is asked
    about the fused ops: saving ``npu_rms_norm`` keeps it out of the backward's recomputation while
    rotary and SwiGLU are still recomputed; training matches eager (fp32)."""
    import functools

    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    asked = set()

    def policy(ctx, op, *args, **kwargs):
        asked.add(str(op))
        return CheckpointPolicy.MUST_SAVE if op is torch.ops.npu.npu_rms_norm.default else CheckpointPolicy.PREFER_RECOMPUTE

    model = tiny_qwen2(**ISSUE)
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={
        "use_reentrant": False, "context_fn": functools.partial(create_selective_checkpoint_contexts, policy)})
    [report] = _train_parity(model)
    assert report.fusions == DENSE_FUSIONS
    backward = report.aot_ops["backward"]
    assert {op: backward.get(op, 0) for op in RECOMPUTED} == dict(RECOMPUTED, npu_rms_norm=0)
    assert "npu.npu_rms_norm.default" in asked
