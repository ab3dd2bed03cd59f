"""``qwen-npu-compile check`` on the simulated Ascend host, as a user runs it there: the model and its inputs on
``npu`` (a ``device:`` line says so), torch_npu's ops (real here: the stand-in), the default downstream torchair
(converted by the wheel's torchair; the GE graph cannot run without CANN, so each AOT graph falls back to
aot_eager at its first run) and ``--downstream aot_eager``; PASS with the exact counts ``check`` expects off-NPU."""

from __future__ import annotations

import json

import pytest
import sim

from qwen_npu_compile import cli
from qwen_npu_compile.ops import ensure_npu_ops

QWEN25 = {"rms_norm": 5, "swiglu": 2, "rotary": 4, "attention": 2}


def run_cli(tmp_path, capsys, *argv):
    out = tmp_path / "check.json"
    status = cli.main(["check", *argv, "--json", str(out)])
    printed = capsys.readouterr().out
    return status, json.loads(out.read_text()), printed


def test_the_npu_ops_are_torch_npus_here():
    status = ensure_npu_ops()
    assert not status.simulated and status.torch_npu_version == "2.13.0"


@pytest.mark.parametrize("downstream", [None, "aot_eager"], ids=["torchair", "aot_eager"])
def test_check_qwen25_passes_on_the_npu(tmp_path, capsys, downstream):
    before = sim.op_calls()
    extra = ["--downstream", downstream] if downstream else []
    status, result, printed = run_cli(tmp_path, capsys, "qwen2.5-0.5b", "--layers", "2", "--vocab-size", "4096", *extra)
    assert "device: npu:0 (Ascend910B2, torch_npu 2.13.0): model and inputs on the NPU" in printed
    assert status == 0 and result["verdict"] == "PASS", result["problems"]
    assert result["settings"]["device"] == "npu:0" and result["versions"]["torch_npu"] == "2.13.0"
    assert {f: v["fused"] for f, v in result["fusions"].items() if v["expected"]} == QWEN25
    assert all(v["fused"] == v["expected"] for v in result["fusions"].values())
    after = sim.op_calls()
    ran = {op: after.get(op, 0) - before.get(op, 0) for op in ("npu_rms_norm", "npu_fusion_attention",
                                                               "npu_fusion_attention_grad", "npu_swiglu_backward")}
    assert all(ran.values()), ran  # torch_npu's ops ran on npu tensors (eager reference runs call none of them)
    backward = result["backward_ops"]
    assert backward["npu_rms_norm_backward"] == 5 and backward["npu_fusion_attention_grad"] == 2
    rotary_backward = "qwen_npu.rotary_mul_orthogonal" if downstream is None else "npu_rotary_mul_backward"
    assert backward[rotary_backward] == 4  # torchair's rotary form (its GE converter), aot_eager's own
    fallbacks = {(f["graph"], f["when"], f["error"].split(":")[0]) for f in result["downstream_fallbacks"]}
    if downstream is None:  # every node converted to GE; only loading the GE graph needs CANN
        assert fallbacks == {("forward", "first run", "CannRequiredError"), ("backward", "first run", "CannRequiredError")}
    else:
        assert not fallbacks
