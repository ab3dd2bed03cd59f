"""Fusing for torchair: every graph we emit must convert (torch_npu 2.13.0 torchair converters).

In-process tests (no torchair needed) compile with ``downstream="torchair"`` as the fusion target and
hand the rewritten graph to aot_eager instead, to check what the rewrite emits for torchair: the
orthogonal rotary form (``qwen_npu.rotary_mul_orthogonal``, whose backward is the forward op with -sin),
the ATen-backward form where sin's halves cannot be proven (``qwen_npu.rotary_mul_aten_backward``), their
parity, the refusals that name a torchair converter limit, fp32 attention refused. The
conversion tests run torchair's real FX→GE conversion off-NPU (``qwen_npu_compile.torchair.offline``)
in a subprocess (importing torchair patches the process) and are skipped when no torch_npu wheel can
be obtained.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from transformers.models.qwen2.modeling_qwen2 import rotate_half

from qwen_npu_compile import get_reports
from qwen_npu_compile.cli.check.harness import run_model
from qwen_npu_compile.cli.check.models import tiny_qwen2
from qwen_npu_compile.ops.qwen_npu import rotary_mul_aten_backward, rotary_mul_orthogonal
from qwen_npu_compile.torchair import converters as ge_converters
from tests.helpers.graphs import count_calls
from tests.helpers.numerics import assert_runs_match, eager_and_reference

TORCHAIR = {"downstream": "torchair"}
ORTHOGONAL = rotary_mul_orthogonal.OP
ATEN_BACKWARD = rotary_mul_aten_backward.OP
NPU = torch.ops.npu


def _refusals(report, family):
    return [r for r in report.refused if r.family == family]


# -- rotary: the orthogonal form on real Qwen2 code ----------------------------------------------------


@pytest.mark.parametrize("head_dim", [16, 64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_qwen2_training_for_torchair_uses_the_orthogonal_rotary(npu_ops, torchair_target_on_aot_eager, dtype, head_dim):
    """Training for torchair: cos/sin from cat(freqs, freqs), no grad -> rotary_mul_orthogonal, whose
    backward is the forward op again (no npu_rotary_mul_backward, whose converter needs D % 64 == 0)."""
    layers = 2
    model = tiny_qwen2(dtype, hidden_size=4 * head_dim, num_attention_heads=4, num_key_value_heads=2).train()
    input_ids = torch.randint(0, 128, (2, 16))
    eager, reference = eager_and_reference(model, input_ids, True, dtype)
    compiled = torch.compile(model, backend="qwen_npu", options={**TORCHAIR, "fusions": "rotary"})
    assert_runs_match(run_model(model, compiled, input_ids, True), eager, reference)
    [report] = get_reports()
    assert report.downstream == "torchair" and report.fusions == {"rotary": 2 * layers}
    assert _refusals(report, "rotary") == []
    graphs = torchair_target_on_aot_eager
    assert count_calls(graphs["forward"], ORTHOGONAL) == 2 * layers
    assert count_calls(graphs["forward"], NPU.npu_rotary_mul.default) == 0
    assert count_calls(graphs["backward"], ORTHOGONAL) == 2 * layers
    assert count_calls(graphs["backward"], NPU.npu_rotary_mul_backward.default) == 0


@pytest.mark.skipif(tuple(int(p) for p in torch.__version__.split(".")[:2]) < (2, 9),
                    reason="torch 2.7 inlines checkpointed regions (compiled unfused, tests/e2e/test_training_variants.py)")
def test_checkpointed_layers_for_torchair_use_the_orthogonal_rotary(npu_ops, torchair_target_on_aot_eager):
    """Inside an activation-checkpointed layer cos/sin are inputs of the region's body: the proof that
    sin = cat(f, f) follows them to the rotary embedding in the calling graph, so head_dim 16 (below the
    backward converter's D % 64) still fuses in the orthogonal form; the backward recomputes it."""
    layers = 2
    model = tiny_qwen2(torch.bfloat16, hidden_size=64, num_attention_heads=4, num_key_value_heads=2).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    input_ids = torch.randint(0, 128, (2, 16))
    eager, reference = eager_and_reference(model, input_ids, True, torch.bfloat16)
    compiled = torch.compile(model, backend="qwen_npu", options={**TORCHAIR, "fusions": "rotary"})
    assert_runs_match(run_model(model, compiled, input_ids, True), eager, reference)
    [report] = get_reports()
    assert report.fusions == {"rotary": 2 * layers} and _refusals(report, "rotary") == []
    graphs = torchair_target_on_aot_eager
    assert count_calls(graphs["backward"], ORTHOGONAL) == 2 * layers * 2  # recomputed forward + the backward itself
    assert count_calls(graphs["backward"], NPU.npu_rotary_mul_backward.default) == 0


def test_qwen3_training_for_torchair_uses_the_orthogonal_rotary(npu_ops, torchair_target_on_aot_eager):
    """Qwen3 normalises q and k per head first: rotary's x is an output of the fused npu_rms_norm, whose
    recorded tensor_meta says no grad. The graph is still a training graph, so the orthogonal form is used
    (npu_rotary_mul_backward's converter would fail under dynamic shapes, and with D % 64 != 0)."""
    import transformers

    config = transformers.Qwen3Config(hidden_size=128, intermediate_size=256, num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=1, head_dim=64, vocab_size=128)
    model = transformers.Qwen3ForCausalLM._from_config(config, attn_implementation="sdpa").to(torch.bfloat16).train()
    input_ids = torch.randint(0, 128, (2, 16))
    eager, reference = eager_and_reference(model, input_ids, True, torch.bfloat16)
    compiled = torch.compile(model, backend="qwen_npu", options=TORCHAIR)
    assert_runs_match(run_model(model, compiled, input_ids, True), eager, reference)
    [report] = get_reports()
    assert report.fusions["rotary"] == 2 and _refusals(report, "rotary") == []
    graphs = torchair_target_on_aot_eager
    assert count_calls(graphs["forward"], ORTHOGONAL) == 2 and count_calls(graphs["forward"], NPU.npu_rotary_mul.default) == 0
    assert count_calls(graphs["backward"], NPU.npu_rotary_mul_backward.default) == 0


def test_qwen2_training_for_torchair_dynamic_sequence_length(npu_ops, torchair_target_on_aot_eager):
    """dynamic=True (verl's varying lengths): the orthogonal form needs no static shape; one graph."""
    dtype, layers = torch.bfloat16, 1
    model = tiny_qwen2(dtype, num_hidden_layers=layers).train()  # head_dim 16
    compiled = torch.compile(model, backend="qwen_npu", options={**TORCHAIR, "fusions": "rotary"}, dynamic=True)
    for seq in (16, 11):
        input_ids = torch.randint(0, 128, (2, seq))
        eager, reference = eager_and_reference(model, input_ids, True, dtype)
        assert_runs_match(run_model(model, compiled, input_ids, True), eager, reference)
    [report] = get_reports()
    assert report.fusions == {"rotary": 2 * layers} and _refusals(report, "rotary") == []
    graphs = torchair_target_on_aot_eager
    assert count_calls(graphs["backward"], ORTHOGONAL) == 2 * layers
    assert count_calls(graphs["backward"], NPU.npu_rotary_mul_backward.default) == 0


def test_qwen2_inference_for_torchair_keeps_npu_rotary_mul(npu_ops, torchair_target_on_aot_eager):
    """No backward, no converter limit to avoid: the plain npu_rotary_mul (RotaryMul) as for other downstreams."""
    model = tiny_qwen2(torch.bfloat16).eval()
    with torch.no_grad():
        torch.compile(model, backend="qwen_npu", options={**TORCHAIR, "fusions": "rotary"})(torch.randint(0, 128, (2, 16)))
    [report] = get_reports()
    assert report.fusions == {"rotary": 4}
    assert count_calls(torchair_target_on_aot_eager["forward"], NPU.npu_rotary_mul.default) == 4
    assert count_calls(torchair_target_on_aot_eager["forward"], ORTHOGONAL) == 0


def test_other_downstreams_keep_npu_rotary_mul_backward(npu_ops):
    model = tiny_qwen2(torch.float32).train()
    run_model(model, torch.compile(model, backend="qwen_npu", options={"fusions": "rotary"}), torch.randint(0, 128, (2, 8)), True)
    [report] = get_reports()
    assert report.aot_ops == {"forward": {"npu_rotary_mul": 4}, "backward": {"npu_rotary_mul_backward": 4}}


# -- rotary: cos/sin the graph cannot prove (graph inputs) ---------------------------------------------


def bsnd_rotary(x_bsnd, cos, sin):
    x = x_bsnd.transpose(1, 2)
    return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)


def _cos_sin(seq: int, head_dim: int, requires_grad: bool = False, equal_halves: bool = True):
    freqs = torch.randn(1, seq, head_dim // 2)
    emb = torch.cat([freqs, freqs], -1) if equal_halves else torch.randn(1, seq, head_dim)
    return emb.cos().requires_grad_(requires_grad), emb.sin().requires_grad_(requires_grad)


def _compile_bsnd(head_dim: int, dynamic_seq: bool = False, equal_halves: bool = True):
    x = torch.randn(2, 8, 4, head_dim, requires_grad=True)
    cos, sin = _cos_sin(8, head_dim, equal_halves=equal_halves)
    if dynamic_seq:  # S symbolic, as Dynamo's automatic dynamic gives verl's varying lengths; D stays static
        for t in (x, cos, sin):
            torch._dynamo.mark_dynamic(t, 1)
    got = torch.compile(bsnd_rotary, backend="qwen_npu", options=TORCHAIR)(x, cos, sin)
    expected = bsnd_rotary(x, cos, sin)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)
    grad = torch.randn_like(expected)
    torch.testing.assert_close(torch.autograd.grad(got, x, grad)[0], torch.autograd.grad(expected, x, grad)[0],
                               atol=1e-6, rtol=1e-6)
    [report] = get_reports()
    return report


@pytest.mark.parametrize("equal_halves", [True, False], ids=["sin_cat_f_f", "sin_any"])
def test_unprovable_sin_with_head_dim_16_fuses_with_the_aten_backward(npu_ops, torchair_target_on_aot_eager,
                                                                      equal_halves):
    """cos/sin are graph inputs (a per-layer graph): sin's halves cannot be proven and D=16 breaks the
    backward converter's D % 64, so the forward is fused and the backward is HF's in ATen ops; the
    gradient is exact for a sin with unequal halves too (where the orthogonal form would be wrong)."""
    report = _compile_bsnd(16, equal_halves=equal_halves)
    assert report.fusions == {"gated_delta_rule": 0, "rms_norm_gated": 0, "moe": 0, "rms_norm": 0, "swiglu": 0, "rotary": 1, "attention": 0}
    assert _refusals(report, "rotary") == []
    graphs = torchair_target_on_aot_eager
    assert count_calls(graphs["forward"], ATEN_BACKWARD) == 1 and count_calls(graphs["forward"], ORTHOGONAL) == 0
    assert count_calls(graphs["backward"], NPU.npu_rotary_mul_backward.default) == 0
    assert count_calls(graphs["backward"], ATEN_BACKWARD) == 0 and count_calls(graphs["backward"], ORTHOGONAL) == 0


def test_unprovable_sin_with_head_dim_64_fuses_with_the_backward_op(npu_ops, torchair_target_on_aot_eager):
    report = _compile_bsnd(64)
    assert report.fusions["rotary"] == 1 and _refusals(report, "rotary") == []
    assert count_calls(torchair_target_on_aot_eager["backward"], NPU.npu_rotary_mul_backward.default) == 1
    assert count_calls(torchair_target_on_aot_eager["forward"], ATEN_BACKWARD) == 0


def test_unprovable_sin_under_dynamic_shapes_fuses_with_the_aten_backward(npu_ops, torchair_target_on_aot_eager):
    """verl's dynamic token count: the backward converter needs static shapes, the ATen backward does not."""
    report = _compile_bsnd(64, dynamic_seq=True, equal_halves=False)
    assert report.fusions["rotary"] == 1 and _refusals(report, "rotary") == []
    graphs = torchair_target_on_aot_eager
    assert count_calls(graphs["forward"], ATEN_BACKWARD) == 1
    assert count_calls(graphs["backward"], NPU.npu_rotary_mul_backward.default) == 0


def test_cos_sin_needing_grad_never_take_the_orthogonal_form(npu_ops, torchair_target_on_aot_eager):
    def rope_from_freqs(x_bsnd, freqs):
        emb = torch.cat([freqs, freqs], -1)
        return bsnd_rotary(x_bsnd, emb.cos(), emb.sin())

    x = torch.randn(2, 8, 4, 16, requires_grad=True)
    freqs = torch.randn(1, 8, 8, requires_grad=True)  # sin has equal halves, but needs grad
    got = torch.compile(rope_from_freqs, backend="qwen_npu", options=TORCHAIR)(x, freqs)
    expected = rope_from_freqs(x, freqs)
    torch.testing.assert_close(got, expected)
    [report] = get_reports()
    assert report.fusions["rotary"] == 0
    [refusal] = _refusals(report, "rotary")
    assert "cos/sin need grad" in refusal.reason and "npu_rotary_mul_backward" in refusal.reason
    assert count_calls(torchair_target_on_aot_eager["forward"], ORTHOGONAL) == 0
    assert count_calls(torchair_target_on_aot_eager["forward"], ATEN_BACKWARD) == 0


def test_orthogonal_op_refuses_cos_sin_that_need_grad(npu_ops):
    from qwen_npu_compile.ops.qwen_npu import rotary_mul_orthogonal

    x = torch.randn(1, 4, 2, 16, requires_grad=True)
    cos, sin = _cos_sin(4, 16, requires_grad=True)
    out = rotary_mul_orthogonal.rotary_mul_orthogonal(x, cos.unsqueeze(2), sin.unsqueeze(2))
    with pytest.raises(RuntimeError, match="need grad"):
        out.sum().backward()


# -- attention: fp32 under torchair ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype,fused", [(torch.float32, 0), (torch.bfloat16, 2)], ids=["fp32", "bf16"])
def test_attention_for_torchair_refuses_fp32(npu_ops, torchair_target_on_aot_eager, dtype, fused):
    model = tiny_qwen2(dtype).eval()
    with torch.no_grad():
        torch.compile(model, backend="qwen_npu", options={**TORCHAIR, "fusions": "attention"})(torch.randint(0, 128, (2, 8)))
    [report] = get_reports()
    assert report.fusions == {"attention": fused}
    reasons = [r.reason for r in _refusals(report, "attention")]
    if fused:
        assert reasons == []
    else:
        assert len(reasons) == 2 and all("FlashAttentionScore" in r and "fp16/bf16" in r for r in reasons)


# -- ge_converters without torchair ---------------------------------------------------------------------


def test_register_converters_without_torchair_warns_and_registers_nothing(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "torchair", None)  # `import torchair` raises ImportError
    with caplog.at_level(logging.WARNING, logger="qwen_npu_compile.torchair.converters"):
        assert ge_converters.register_converters() == []
    assert "could not be imported" in caplog.text


# -- torchair's real FX→GE conversion, off-NPU (subprocess) -------------------------------------------

_CONVERT = textwrap.dedent(
    """
    import json, sys, torch
    from qwen_npu_compile import get_reports
    from qwen_npu_compile.torchair.offline import TorchairUnavailableError, load_offline_torchair
    try:
        load_offline_torchair()
    except TorchairUnavailableError as exc:
        print(json.dumps({"unavailable": str(exc)})); sys.exit(0)
    hidden, dtype, dynamic, fusions = json.loads(sys.argv[1])
    from qwen_npu_compile.cli.check.models import tiny_qwen2
    model = tiny_qwen2(getattr(torch, dtype), hidden_size=hidden, num_hidden_layers=1).train()
    compiled = torch.compile(model, backend="qwen_npu", options={"downstream": "torchair", "fusions": fusions},
                             dynamic=dynamic)
    for seq in ((16, 11) if dynamic else (16,)):
        ids = torch.randint(0, 128, (2, seq))
        compiled(input_ids=ids, labels=ids).loss.backward()
    out = []
    for report in get_reports():
        ge = report.ge
        out.append({"fusions": report.fusions, "graphs": [{"kind": g.kind, "ops": g.ops} for g in ge.graphs],
                    "failures": [{"op": f.op, "error": f.error} for f in ge.failures]})
    print(json.dumps({"reports": out}))
    """
)


def _convert(hidden: int, dtype: str, dynamic: bool, fusions: str = "all") -> list:
    env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    done = subprocess.run([sys.executable, "-c", _CONVERT, json.dumps([hidden, dtype, dynamic, fusions])],
                          capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if "unavailable" in result:
        pytest.skip(f"torchair off-NPU unavailable: {result['unavailable']}")
    return result["reports"]


@pytest.mark.parametrize("hidden,dynamic", [(64, False), (64, True), (256, False)],
                         ids=["d16-static", "d16-dynamic", "d64-static"])
def test_training_graph_converts_with_torchair(npu_ops, hidden, dynamic):
    """Every fusion applied, forward and backward: 0 conversion failures; FlashAttentionScoreGrad (5
    outputs via our converter), RotaryMul (the orthogonal backward), no RotaryMulGrad; SwiGlu on the
    ConcatD of gate_up_proj's two matmuls."""
    [report] = _convert(hidden, "bfloat16", dynamic)
    assert report["failures"] == []
    assert report["fusions"] == {"gated_delta_rule": 0, "rms_norm_gated": 0, "moe": 0, "rms_norm": 3, "swiglu": 1, "rotary": 2, "attention": 1}
    ops = {g["kind"]: g["ops"] for g in report["graphs"]}
    assert ops["forward"]["FlashAttentionScore"] == 1 and ops["forward"]["RotaryMul"] == 2
    assert ops["backward"]["FlashAttentionScoreGrad"] == 1 and ops["backward"]["RotaryMul"] == 2
    assert "RotaryMulGrad" not in ops["backward"]
    # SwiGLU: qwen_npu.gate_up_proj -> our converter's 2 BatchMatMulV2 + ConcatD (axis 0) -> SwiGlu;
    # its backward is ATen mm/add, converted by torchair itself (MatMul)
    assert (ops["forward"]["BatchMatMulV2"], ops["forward"]["ConcatD"], ops["forward"]["SwiGlu"]) == (2, 1, 1)
    assert ops["backward"]["SwiGluGrad"] == 1 and "ConcatD" not in ops["backward"]


def test_unfused_swiglu_backward_converts_with_torchair(npu_ops):
    """SwiGLU disabled: aten.silu_backward (a stub in torchair) converts with our Sigmoid/SigmoidGrad form.
    (With torch 2.9.0 and torch_npu 2.9.0's torchair, AOTAutograd decomposes silu_backward itself:
    Sigmoid/Mul/Sub, no SigmoidGrad.)"""
    [report] = _convert(64, "bfloat16", False, fusions="rms_norm,rotary,attention")
    assert report["failures"] == []
    backward = next(g["ops"] for g in report["graphs"] if g["kind"] == "backward")
    torch_version = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
    assert backward["Sigmoid"] == 1
    if torch_version >= (2, 13):  # verified with torch 2.13.0: silu_backward reaches our converter
        assert backward["SigmoidGrad"] == 1


# -- the limits by graph node (for the conversion check) -----------------------------------------------


def test_graph_violations_name_the_torchair_limits(npu_ops):
    from torch.fx.experimental.proxy_tensor import make_fx

    from qwen_npu_compile.ops import limits

    def emitted(x, cos, q, k):
        out = torch.ops.npu.npu_rotary_mul.default(x, cos, cos, "half")
        dx = torch.ops.npu.npu_rotary_mul_backward.default(out, x, cos, cos)[0]
        return dx, ORTHOGONAL(x, cos, cos), torch.ops.npu.npu_fusion_attention.default(q, k, k, 4, "BNSD", scale=0.25)[0]

    def graph(dtype, head_dim):
        x, cos = torch.randn(2, 8, 4, head_dim, dtype=dtype), torch.randn(1, 8, 1, head_dim, dtype=dtype)
        q, k = torch.randn(2, 4, 8, head_dim, dtype=dtype), torch.randn(2, 2, 8, head_dim, dtype=dtype)
        return make_fx(emitted, tracing_mode="fake")(x, cos, q, k).graph

    found = {node.name: reason for node, reason in limits.graph_violations(graph(torch.float32, 16))}
    assert sorted(found) == ["npu_fusion_attention", "npu_rotary_mul_backward"]
    assert "D % 64 == 0, got D=16" in found["npu_rotary_mul_backward"]
    assert "FlashAttentionScore" in found["npu_fusion_attention"]
    assert limits.graph_violations(graph(torch.bfloat16, 64)) == []
    assert limits.graph_violations(graph(torch.float32, 16), downstream="aot_eager") == []
