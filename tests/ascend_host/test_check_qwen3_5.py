"""``qwen-npu-compile check qwen3.5-0.8b --layers 4`` on the simulated Ascend host (linear head dims 128: the delta
rule's forward calls torch_npu's ``npu_chunk_gated_delta_rule`` inside its contract), default downstream (torchair)
and aot_eager: PASS, model on ``npu``, the exact counts of the check off-NPU."""

from __future__ import annotations

import pytest
import sim
from test_check import run_cli

QWEN35 = {"gated_delta_rule": 3, "rms_norm_gated": 3, "rms_norm": 11, "swiglu": 4, "rotary": 2, "attention": 1}


@pytest.mark.parametrize("downstream", [None, "aot_eager"], ids=["torchair", "aot_eager"])
def test_check_qwen35_passes_on_the_npu(tmp_path, capsys, downstream):
    extra = ["--downstream", downstream] if downstream else []
    status, result, printed = run_cli(tmp_path, capsys, "qwen3.5-0.8b", "--layers", "4", "--vocab-size", "4096", *extra)
    assert "device: npu:0" in printed and result["settings"]["device"] == "npu:0"
    assert status == 0 and result["verdict"] == "PASS", result["problems"]
    assert {f: v["fused"] for f, v in result["fusions"].items() if v["expected"]} == QWEN35
    assert all(v["fused"] == v["expected"] for v in result["fusions"].values())
    assert sim.op_calls().get("npu_rms_norm", 0) and sim.op_calls().get("npu_fusion_attention_grad", 0)
    if downstream is None:  # torchair falls back per AOT graph (conversion gaps or GE needing CANN), never the whole
        assert {f["graph"] for f in result["downstream_fallbacks"]} == {"forward", "backward"}
