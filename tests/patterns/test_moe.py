"""MoE: tiny Qwen3-MoE and Qwen2-MoE of transformers' real modeling code, whole model, training.

The experts' grouped matmuls become ``qwen_npu::grouped_matmul`` (``npu_grouped_matmul`` forward and
backward) with ``npu_swiglu`` on the gate/up output; the router's ``softmax -> topk`` is not attention (no
near miss, so ``strict`` passes); parity with eager, forward and backward.
"""

from __future__ import annotations

import logging
from collections import Counter

import pytest
import torch
import transformers

from qwen_npu_compile.cli.check import memory
from qwen_npu_compile.ops.qwen_npu import grouped_matmul as gmm
from qwen_npu_compile.patterns import expected_fusions
from tests.helpers.models import tiny_moe, token_ids
from tests.helpers.numerics import assert_parity
from tests.helpers.torchair import run_ge_script

LAYERS = 2


#: (family, dtype): Qwen3-MoE in bf16 (aten._grouped_mm) and Qwen2-MoE in fp32 (transformers::grouped_mm_fallback,
#: its shared expert and sigmoid gate); one whole-model training compile each (the host budget).
CASES = [("qwen3_moe", torch.bfloat16), ("qwen2_moe", torch.float32)]


@pytest.mark.parametrize(("family", "dtype"), CASES)
def test_experts_fuse_into_grouped_matmul_with_parity_and_strict(family, dtype, tmp_path, rewritten):
    model = tiny_moe(family, dtype)
    reports = assert_parity(model, token_ids(), True, dtype, options={"strict": True, "dump_dir": str(tmp_path)})
    assert len(reports) == 1
    (report,) = reports
    # no refusal, and the router softmaxes are neither attention near misses nor attention anchors
    assert [r.reason for r in report.refused] == []
    assert report.anchors["attention"] == LAYERS
    expected = expected_fusions(model.config)
    assert expected["moe"] == 2 * LAYERS
    assert expected["swiglu"] == (LAYERS if family == "qwen2_moe" else 0)  # Qwen2-MoE's shared expert
    assert report.fusions == expected
    assert report.already_fused["swiglu"] == 0  # moe's npu_swiglu is moe's (check adds already-fused to fused)
    fused = "moe_grouped_mm" if dtype == torch.bfloat16 else "moe_fallback"
    assert {v: n for v, n in report.variants.items() if v.startswith("moe")} == {fused: LAYERS, f"{fused}_swiglu": LAYERS}
    # npu_swiglu reads the gate_up grouped matmul directly: no cat
    (graph,) = rewritten
    swiglus = [n for n in graph.graph.nodes if n.target is torch.ops.npu.npu_swiglu.default
               and n.args[0].target is gmm.OP]
    assert len(swiglus) == LAYERS
    # the AOT graphs: grouped matmuls only (forward: ours; backward: dx and dW per fused matmul)
    forward, backward = ("\n".join(line for line in (tmp_path / report.name / f"aot_{kind}.py").read_text().splitlines()
                                   if not line.lstrip().startswith("#"))  # code, not its source comments
                         for kind in ("forward", "backward"))
    for text in (forward, backward):
        assert "torch.ops.aten._grouped_mm" not in text and "torch.ops.transformers.grouped_mm_fallback" not in text
    assert forward.count("torch.ops.qwen_npu.grouped_matmul.default(") == 2 * LAYERS
    assert report.aot_ops["backward"]["npu_grouped_matmul"] == 2 * 2 * LAYERS
    assert "aten.cat.default([getitem" not in forward


def test_loop_experts_stay_unfused_with_one_warning(caplog):
    """Experts run as a per-expert loop (transformers 4.57's nn.ModuleList; on 5.x experts_implementation="eager",
    the same loop): graph breaks, no crash, attention/norms/rotary fused, parity, and exactly one warning naming
    what to use instead."""
    tf5 = int(transformers.__version__.split(".")[0]) >= 5
    model = tiny_moe("qwen3_moe", torch.float32, **({"experts_implementation": "eager"} if tf5 else {}))
    with caplog.at_level(logging.WARNING, logger="qwen_npu_compile"):
        reports = assert_parity(model, token_ids(), True, torch.float32)
    warned = [r.getMessage() for r in caplog.records if "per-expert loop" in r.getMessage()]
    assert len(warned) == 1 and "experts_implementation='grouped_mm'" in warned[0], warned
    totals = {f: sum(r.fusions[f] for r in reports) for f in reports[0].fusions}
    # the decoder layer's graph is compiled once and reused by both layers (guards pass): 4 norms, 2 rotary, 1
    # attention; plus the final norm; each expert MLP graph fuses its swiglu; no grouped matmul
    assert (totals["moe"], totals["attention"], totals["rotary"], totals["rms_norm"]) == (0, 1, 2, 5)
    # measured: transformers 5.24 eager experts 11 graphs, the loop body's silu split from its mul by the breaks
    # (2 swiglu near misses); 4.57.6 ModuleList experts 9 graphs, each expert's Qwen3MoeMLP graph fuses its swiglu
    # (compiled twice: static, then dynamic token count)
    refused = [(r.family, r.reason) for report in reports for r in report.refused]
    if tf5:
        assert (len(reports), totals["swiglu"]) == (11, 0)
        assert refused == [("swiglu", "near miss: aten.silu.default at activations.py:103 is not inside a complete "
                                      "swiglu subgraph")] * 2
    else:
        assert (len(reports), totals["swiglu"], refused) == (9, 2, [])


GE_SCRIPT = """
import json, os, sys
import torch
from qwen_npu_compile import ensure_npu_ops, get_reports, maybe_compile
from qwen_npu_compile.report import SUMMARY
ensure_npu_ops()
from tests.helpers.models import tiny_moe, token_ids
os.environ["QWEN_NPU_COMPILE"] = "1"
cases = {}
for family in ("qwen3_moe", "qwen2_moe"):
    for where in ("whole", "layers"):
        SUMMARY.graphs.clear()
        torch._dynamo.reset()
        model = tiny_moe(family, torch.bfloat16).train()
        options = {"downstream": "torchair", "dump_dir": os.path.join(sys.argv[1], family, where)}
        if where == "whole":
            compiled = torch.compile(model, backend="qwen_npu", options=options)
        else:
            maybe_compile(model, options)
            compiled = model
        compiled(input_ids=token_ids(), labels=token_ids()).loss.backward()
        cases[f"{family}-{where}"] = [dict(report.as_dict()["ge"], fusions=report.fusions) for report in get_reports()]
print(json.dumps([cases]))
"""


@pytest.fixture(scope="module")
def ge_cases(tmp_path_factory):
    """torchair's FX->GE conversion (off-NPU; skipped without the torch_npu wheel) of a bf16 training step of
    tiny Qwen3-MoE and Qwen2-MoE, whole model and per decoder layer (maybe_compile), in one fresh interpreter."""
    (cases,) = run_ge_script(GE_SCRIPT, tmp_path_factory.mktemp("moe_ge"))
    return cases


def _ge_ops(reports: list, kind: str) -> Counter:
    """GE op counts over every GE graph of ``kind`` of the case's reports."""
    return sum((Counter(g["ops"]) for r in reports for g in r["graphs"] if g["kind"] == kind), Counter())


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
@pytest.mark.parametrize("where", ["whole", "layers"])
def test_training_graphs_convert_for_ge_off_npu(simulated_npu_ops, ge_cases, family, where):
    """Forward and backward GE graphs of a tiny MoE bf16 training step, off-NPU: 0 failures; GroupedMatmul per
    fused grouped matmul (backward: dx and dW), SwiGlu on the experts (and Qwen2-MoE's shared expert), the
    routing as SearchSorted / ScatterElements (no histc, no index_put); per layer: one graph for both layers."""
    reports = ge_cases[f"{family}-{where}"]
    assert len(reports) == 1, [r["fusions"] for r in reports]  # per layer: one graph both layers call
    assert [r["failures"] for r in reports] == [[]]
    per_graph = LAYERS if where == "whole" else 1
    fused = sum(r["fusions"]["moe"] for r in reports)
    assert fused == 2 * per_graph
    forward, backward = _ge_ops(reports, "forward"), _ge_ops(reports, "backward")
    swiglu = per_graph * (2 if family == "qwen2_moe" else 1)  # experts (+ the shared expert's MLP)
    assert forward["GroupedMatmul"] == 2 * per_graph and backward["GroupedMatmul"] == 2 * 2 * per_graph
    assert forward["SwiGlu"] == swiglu and backward["SwiGluGrad"] == swiglu
    assert (forward["SearchSorted"], forward["ScatterElements"]) == (per_graph, per_graph)


#: preset -> (published total parameters, in billions; the model cards), the family's expected counts (whole model).
PRESETS = {
    "qwen3-30b-a3b": (30.5, {"gated_delta_rule": 0, "rms_norm_gated": 0, "rms_norm": 4 * 48 + 1, "moe": 2 * 48, "swiglu": 0, "rotary": 2 * 48, "attention": 48}),
    "qwen3-235b-a22b": (235.0, {"gated_delta_rule": 0, "rms_norm_gated": 0, "rms_norm": 4 * 94 + 1, "moe": 2 * 94, "swiglu": 0, "rotary": 2 * 94, "attention": 94}),
    "qwen1.5-moe-a2.7b": (14.3, {"gated_delta_rule": 0, "rms_norm_gated": 0, "rms_norm": 2 * 24 + 1, "moe": 2 * 24, "swiglu": 24, "rotary": 2 * 24, "attention": 24}),
    "qwen2-57b-a14b": (57.4, {"gated_delta_rule": 0, "rms_norm_gated": 0, "rms_norm": 2 * 28 + 1, "moe": 2 * 28, "swiglu": 28, "rotary": 2 * 28, "attention": 28}),
}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_moe_presets_match_the_published_models(name):
    """The presets' shapes give the published parameter totals (within 1%), and ``check`` expects the moe
    family's counts (2 per sparse layer; swiglu: Qwen2-MoE's shared expert; rms_norm: Qwen3's q/k norms)."""
    from qwen_npu_compile.cli.check import models

    billions, counts = PRESETS[name]
    config = models.resolve_model_config(name)
    assert config.model_type in ("qwen2_moe", "qwen3_moe")
    assert abs(memory.estimate_num_parameters(config) / 1e9 - billions) / billions < 0.01
    assert expected_fusions(config) == counts
    assert expected_fusions(config, per_layer=True)["moe"] == 2
    two = models.with_layers(config, 2)
    assert expected_fusions(two)["moe"] == 4
