"""torchair FX->GE conversion (off-NPU, torch_npu 2.13.0 wheel) of packed-sequence graphs: the varlen ops
through this project's converters (``qwen_npu_compile/ops/qwen_npu/varlen_attention_ge.py``).

One subprocess (``torchair_varlen_cases.py``; importing torchair patches torch process-wide) converts every
case and describes the GE graphs; the tests below read its JSON. Cases: a toy module (q/k/v projections
and ``qwen_npu.varlen_attention`` with ``seq_ends`` a CPU int64 graph input) in inference and training,
static and dynamic T (``torch.compile(dynamic=True)``, two packings), bf16 and fp16; the same with
``seq_ends_from_positions`` in the graph; fp32 (refused by the converter with ``varlen_violation``'s
reason); a packed tiny Qwen2 (2 layers, head_dim 64, GQA 4/2), whole-model compile and ``maybe_compile``
per decoder layer, training and inference. Skipped when no torch_npu wheel can be obtained.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from qwen_npu_compile.torchair import converters as ge_converters
from tests.helpers import DRIVERS, REPO

SCRIPT = DRIVERS / "torchair_varlen_cases.py"

TOY = [f"toy-{mode}-{dtype}-{shape}" for mode in ("infer", "train") for dtype in ("bf16", "fp16")
       for shape in ("static", "dynamic")]
MODELS = ["qwen2-train-bf16-static", "qwen2-infer-bf16-static", "layers-train-bf16-static", "layers-infer-bf16-static"]
CASES = [*TOY, "toy-train-fp32-static", "positions-train-bf16-dynamic", *MODELS]

#: The toy's first packing (both T and the sequence count change in its second, dynamic cases only).
TOKENS, SEQUENCES, HEADS, HEAD_DIM = 16, 3, 4, 64
GE_DTYPE = {"bf16": "DT_BF16", "fp16": "DT_FLOAT16"}
#: The model cases' packing: 4 sequences, T = 64.
MODEL_TOKENS = 64


@pytest.fixture(scope="module")
def converted():
    env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(SCRIPT), json.dumps(CASES)], capture_output=True, text=True,
                          timeout=900, env=env, cwd=REPO)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if "unavailable" in result:
        pytest.skip(f"torchair off-NPU unavailable: {result['unavailable']}")
    return result


def _only_report(case: dict) -> dict:
    [report] = case["reports"]  # dynamic cases: the second packing reused the graph
    return report


def _fused(report: dict) -> dict[str, int]:
    """The families that fused something (a family a model cannot use, e.g. moe, counts 0)."""
    return {family: count for family, count in report["fusions"].items() if count}


def _graphs(case: dict, kind: str) -> list[dict]:
    """The GE nodes captured per GE graph of ``kind`` ("forward" graphs come first, then "backward")."""
    report = _only_report(case)
    kinds = [graph["kind"] for graph in report["graphs"]]
    return [nodes for nodes, graph_kind in zip(case["ge_nodes"], kinds) if graph_kind == kind]


def _nodes(graph: dict, op: str) -> list[dict]:
    return [node for node in graph["nodes"] if node["type"] == op]


def _assert_attention_node(node: dict, *, heads: int, scale: float, ends_from: str, dynamic: bool):
    """Attributes and inputs of one FlashAttentionScore(Grad) node our converter emitted."""
    assert node["attrs"] == {"input_layout": "TND", "sparse_mode": 3, "head_num": heads, "keep_prob": 1.0,
                             "scale_value": pytest.approx(scale), "inner_precise": 0,
                             "pre_tockens": 2147483647, "next_tockens": 2147483647}
    inputs = node["inputs"]
    q_ends, kv_ends = inputs["actual_seq_qlen"], inputs["actual_seq_kvlen"]
    assert q_ends == kv_ends and q_ends["type"] == ends_from
    if ends_from == "Data":  # a CPU int64 graph input is a host Data (fx2ge_converter.parse_input)
        assert (q_ends["placement"], q_ends["dtype"]) == ("CPU", "DT_INT64")
        assert q_ends["shape"] == ([-1] if dynamic else [SEQUENCES])
    assert (inputs["atten_mask"]["type"], inputs["atten_mask"]["name"]) == ("Greater", "qwen_npu_compressed_causal_mask")
    assert inputs["real_shift" if node["type"] == "FlashAttentionScore" else "pse_shift"] is None
    assert inputs["padding_mask"] is None and inputs["drop_mask"] is None and inputs["prefix"] is None


# ---------------------------------------------------------------------------------------------------
# in-process (no torchair)


def test_varlen_converters_are_registered_by_name():
    assert {"qwen_npu.varlen_attention", "qwen_npu.varlen_attention_backward",
            "qwen_npu.seq_ends_from_positions"} <= set(ge_converters._CONVERTERS)


def test_drop_runtime_asserts_removes_the_unbacked_size_checks():
    """Dynamo asserts an unbacked size (``mark_unbacked``, as substitutions/varlen_attention.py marks seq_ends) with
    ``sym_size >= 0`` + ``_assert_scalar``, which torchair cannot interpret; dropping them leaves a graph
    that computes the same."""
    captured = []

    def backend(gm, example_inputs):
        asserts = gm.graph.find_nodes(op="call_function", target=torch.ops.aten._assert_scalar.default)
        captured.append((gm, len(asserts), ge_converters.drop_runtime_asserts(gm.graph)))
        gm.recompile()
        return gm.forward

    def scaled(x, ends):
        return x * ends.shape[0]

    x, ends = torch.randn(4), torch.tensor([2, 4])
    torch._dynamo.reset()
    torch._dynamo.decorators.mark_unbacked(ends, 0)
    compiled = torch.compile(scaled, backend=backend, fullgraph=True)
    torch.testing.assert_close(compiled(x, ends), scaled(x, ends))
    [(gm, asserts, dropped)] = captured
    assert asserts >= 1 and len(dropped) == asserts and all("Runtime assertion failed" in text for text in dropped)
    assert not any(node.target in ge_converters.RUNTIME_ASSERTS for node in gm.graph.nodes)
    assert not any(node.op == "call_function" and not node.users and ge_converters._symbolic(node)
                   for node in gm.graph.nodes)
    more = torch.tensor([1, 2, 3, 4])
    torch.testing.assert_close(compiled(x, more), scaled(x, more))  # the same graph, another length
    assert len(captured) == 1
    torch._dynamo.reset()


# ---------------------------------------------------------------------------------------------------
# the GE subgraphs of the converters, evaluated (NumPy model of the GE ops)


def test_seq_ends_and_mask_subgraphs_compute_what_the_kernels_do(converted):
    ir = converted["ir"]
    assert ir["rows"] == 24 and ir["mismatches"] == []  # 6 rows x 2 rules x int64/int32 position ids
    assert ir["mask_equal"] and ir["mask_shape"] == [2048, 2048] and ir["mask_built_once"]


# ---------------------------------------------------------------------------------------------------
# (a) the toy module: inference and training, static and dynamic T, bf16 and fp16


@pytest.mark.parametrize("name", TOY)
def test_varlen_attention_converts_to_tnd_flash_attention(converted, name):
    _, mode, dtype, shape = name.split("-")
    case = converted["cases"][name]
    report = _only_report(case)
    assert report["failures"] == [] and report["downstream"] == "torchair" and report["downstream_fallbacks"] == []
    assert _fused(report) == {"attention": 1}
    assert case["max_abs_error"] == 0.0  # run_eagerly: the FX graph ran the op's own kernels
    kinds = ["forward", "backward"] if mode == "train" else ["forward"]
    assert [graph["kind"] for graph in report["graphs"]] == kinds
    dynamic = shape == "dynamic"
    [forward] = _graphs(case, "forward")
    [node] = _nodes(forward, "FlashAttentionScore")
    _assert_attention_node(node, heads=HEADS, scale=HEAD_DIM ** -0.5, ends_from="Data", dynamic=dynamic)
    assert forward["causal_masks"] == 1
    # outputs against the op's meta: softmax_max / softmax_sum [T, N, 8] fp32, out in q's dtype
    names = [output["name"] for output in node["outputs"]]
    assert names == ["softmax_max", "softmax_sum", "softmax_out", "attention_out"]
    tokens = r"s\d+" if dynamic else str(TOKENS)
    for stat in node["outputs"][:2]:
        assert stat["dtype"] == "DT_FLOAT"
        assert re.fullmatch(rf"Tensor\(dtype=torch.float32, shape=torch.Size\(\[{tokens}, {HEADS}, 8\]\)", stat["meta"])
    assert node["outputs"][3]["dtype"] == GE_DTYPE[dtype]
    if mode == "train":
        [backward] = _graphs(case, "backward")
        [grad] = _nodes(backward, "FlashAttentionScoreGrad")
        _assert_attention_node(grad, heads=HEADS, scale=HEAD_DIM ** -0.5, ends_from="Data", dynamic=dynamic)
        for stat in ("softmax_max", "softmax_sum"):  # the forward's outputs, saved for backward
            saved = grad["inputs"][stat]
            assert (saved["type"], saved["dtype"]) == ("Data", "DT_FLOAT")
            assert saved["shape"] == [-1 if dynamic else TOKENS, HEADS, 8]
        assert grad["inputs"]["attention_in"] is not None and grad["inputs"]["softmax_in"] is None
        assert [output["dtype"] for output in grad["outputs"][:3]] == [GE_DTYPE[dtype]] * 3
        assert backward["causal_masks"] == 1


# ---------------------------------------------------------------------------------------------------
# (b) seq_ends_from_positions in the graph


def test_seq_ends_from_positions_converts_to_nonzero_and_concat(converted):
    case = converted["cases"]["positions-train-bf16-dynamic"]
    report = _only_report(case)
    assert report["failures"] == [] and report["downstream_fallbacks"] == []
    forward_ops = report["graphs"][0]["ops"]
    # ours: StridedSliceV2 x2 (p[1:], p[:-1]), NotEqual, NonZero, ConcatV2 (+ a Shape, beside torchair's own)
    assert {op: forward_ops.get(op) for op in ("NonZero", "ConcatV2", "StridedSliceV2", "NotEqual")} == {
        "NonZero": 1, "ConcatV2": 1, "StridedSliceV2": 2, "NotEqual": 1}
    [forward] = _graphs(case, "forward")
    [nonzero] = _nodes(forward, "NonZero")
    assert nonzero["inputs"]["x"]["type"] == "NotEqual"  # the "restart" rule
    [node] = _nodes(forward, "FlashAttentionScore")
    _assert_attention_node(node, heads=HEADS, scale=HEAD_DIM ** -0.5, ends_from="ConcatV2", dynamic=True)
    [backward] = _graphs(case, "backward")
    [grad] = _nodes(backward, "FlashAttentionScoreGrad")
    # the forward's ends, saved for backward: a host Data of dynamic length
    _assert_attention_node(grad, heads=HEADS, scale=HEAD_DIM ** -0.5, ends_from="Data", dynamic=True)


# ---------------------------------------------------------------------------------------------------
# (c) refused: fp32 q/k/v (GE's FlashAttentionScore takes fp16/bf16 only)


def test_fp32_varlen_attention_is_refused_with_the_limit_reason(converted):
    from qwen_npu_compile.ops.qwen_npu import varlen_attention

    q = torch.empty(TOKENS, HEADS, HEAD_DIM)
    kv = torch.empty(TOKENS, 2, HEAD_DIM)
    reason = varlen_attention.varlen_violation(q, kv, kv, None, HEADS, downstream="torchair")
    assert reason is not None and "fp16/bf16" in reason
    report = _only_report(converted["cases"]["toy-train-fp32-static"])
    assert [(f["op"], f["kind"]) for f in report["failures"]] == [
        ("qwen_npu.varlen_attention.default", "converter"), ("qwen_npu.varlen_attention_backward.default", "converter")]
    for failure in report["failures"]:
        assert failure["error"].startswith("NotImplementedError: qwen_npu.varlen_attention")
        assert failure["error"].endswith(reason), failure["error"]
    assert all("FlashAttentionScore" not in graph["ops"] and "FlashAttentionScoreGrad" not in graph["ops"]
               for graph in report["graphs"])


# ---------------------------------------------------------------------------------------------------
# a packed tiny Qwen2: whole model (patterns/attention/varlen.py) and per decoder layer (substitutions/varlen_attention.py)


@pytest.mark.parametrize("mode", ["train", "infer"])
def test_packed_qwen2_whole_model_converts(converted, mode):
    """2 layers: 5/2/4/2 fusions, both attentions varlen; one seq_ends_from_positions (NonZero) and one
    causal mask per GE graph, read by both FlashAttentionScore nodes."""
    case = converted["cases"][f"qwen2-{mode}-bf16-static"]
    report = _only_report(case)
    assert report["failures"] == [] and report["downstream"] == "torchair" and report["downstream_fallbacks"] == []
    assert _fused(report) == {"rms_norm": 5, "swiglu": 2, "rotary": 4, "attention": 2}
    assert report["variants"]["varlen_sdpa_mask_repeat_kv"] == 2
    assert case["max_abs_error"] < 0.05  # loss (train) / bf16 logits (infer) against eager; parity: test_attention_varlen.py
    [forward] = _graphs(case, "forward")
    attention = _nodes(forward, "FlashAttentionScore")
    assert len(attention) == 2 and len(_nodes(forward, "NonZero")) == 1 and forward["causal_masks"] == 1
    for node in attention:
        _assert_attention_node(node, heads=HEADS, scale=HEAD_DIM ** -0.5, ends_from="ConcatV2", dynamic=False)
    assert attention[0]["inputs"]["actual_seq_qlen"] == attention[1]["inputs"]["actual_seq_qlen"]
    if mode == "train":
        [backward] = _graphs(case, "backward")
        grads = _nodes(backward, "FlashAttentionScoreGrad")
        assert len(grads) == 2 and backward["causal_masks"] == 1
        for node in grads:
            ends = node["inputs"]["actual_seq_qlen"]
            assert (ends["type"], ends["placement"], ends["dtype"], ends["shape"]) == ("Data", "CPU", "DT_INT64", [-1])
            _assert_attention_node(node, heads=HEADS, scale=HEAD_DIM ** -0.5, ends_from="Data", dynamic=True)


@pytest.mark.parametrize("mode", ["train", "infer"])
def test_packed_qwen2_per_layer_converts(converted, mode):
    """maybe_compile: one graph for both decoder layers (2/1/2/1), its seq_ends a host Data."""
    case = converted["cases"][f"layers-{mode}-bf16-static"]
    report = _only_report(case)
    assert report["downstream_fallbacks"] == [] and report["downstream"] == "torchair"
    assert report["failures"] == []
    assert _fused(report) == {"rms_norm": 2, "swiglu": 1, "rotary": 2, "attention": 1}
    [forward] = _graphs(case, "forward")
    [node] = _nodes(forward, "FlashAttentionScore")
    _assert_attention_node(node, heads=HEADS, scale=HEAD_DIM ** -0.5, ends_from="Data", dynamic=True)
    assert len(_nodes(forward, "RotaryMul")) == 2
    if mode == "train":
        # The packed layer's token dim is dynamic from the first call (substitutions/varlen_attention.py
        # mark_tokens_dynamic) and cos/sin are graph inputs (sin = cat(f, f) cannot be proven): rotary is
        # qwen_npu.rotary_mul_aten_backward, RotaryMul forward and a backward of plain ATen ops
        # (torchair's RotaryMulGrad converter refuses dynamic shapes; patterns/rotary.py).
        assert report["variants"]["rotary_bsnd"] == 2
        [backward] = _graphs(case, "backward")
        assert _nodes(backward, "RotaryMulGrad") == [] and _nodes(backward, "RotaryMul") == []
        [grad] = _nodes(backward, "FlashAttentionScoreGrad")
        _assert_attention_node(grad, heads=HEADS, scale=HEAD_DIM ** -0.5, ends_from="Data", dynamic=True)
