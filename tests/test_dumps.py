"""Dump folders, report.json and each dump folder's summary.json; the per-graph log line."""

import json
import logging

import torch

from qwen_npu_compile.cli.check.models import tiny_qwen2


def test_dump_dir_layout_and_summary(npu_ops, tmp_path, caplog):
    model = tiny_qwen2(torch.bfloat16).train()
    ids = torch.randint(0, 128, (2, 8))
    with caplog.at_level(logging.INFO, logger="qwen_npu_compile"):
        out = torch.compile(model, backend="qwen_npu", options={"dump_dir": str(tmp_path), "fusions": "rms_norm,swiglu"})(
            input_ids=ids, labels=ids
        )
        out.loss.backward()
    folders = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert len(folders) == 1
    folder = folders[0]
    names = sorted(p.name for p in folder.iterdir())
    assert names == ["aot_backward.py", "aot_forward.py", "canonical.py", "captured.py", "report.json", "rewritten.py"]
    assert "npu.npu_rms_norm.default" in (folder / "rewritten.py").read_text()
    assert "npu_rms_norm" not in (folder / "canonical.py").read_text()
    assert "npu.npu_rms_norm_backward.default" in (folder / "aot_backward.py").read_text()

    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["simulated"] is True
    assert summary["versions"]["torch"] == torch.__version__
    assert summary["totals"] == {"rms_norm": 5, "swiglu": 2}
    assert summary["variants"] == {"rms_norm_half": 5, "swiglu_linear_silu_left": 2}
    (graph,) = summary["graphs"]
    assert graph["name"] == folder.name
    assert graph["fusions"] == {"rms_norm": 5, "swiglu": 2}
    assert graph["aot_ops"]["backward"] == {"npu_rms_norm_backward": 5, "npu_swiglu_backward": 2}
    # rotary/attention are disabled here: their anchors are listed with the reason
    assert graph["refused"] and all(set(r) == {"family", "reason", "source", "node"} for r in graph["refused"])
    assert {r["family"] for r in graph["refused"]} <= {"rotary", "attention"}
    report = json.loads((folder / "report.json").read_text())
    assert report["fusions"] == graph["fusions"]

    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("qwen_npu [")]
    assert "[simulated npu ops]" in line and "rms_norm 5" in line and "swiglu 2" in line


def test_summary_accumulates_over_graphs(npu_ops, tmp_path, monkeypatch):
    monkeypatch.setenv("QWEN_NPU_DUMP_DIR", str(tmp_path))
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    first, second = Qwen2RMSNorm(16), Qwen2RMSNorm(32)
    torch.compile(first, backend="qwen_npu")(torch.randn(2, 16))
    torch.compile(second, backend="qwen_npu")(torch.randn(2, 32))
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [g["fusions"]["rms_norm"] for g in summary["graphs"]] == [1, 1]
    assert summary["totals"]["rms_norm"] == 2


def test_each_dump_folder_summarises_only_its_own_graphs(npu_ops, tmp_path):
    """Two models compiled in one process with two dump dirs: each summary.json holds its own graph only."""
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    first, second = Qwen2RMSNorm(16), Qwen2RMSNorm(32)
    torch.compile(first, backend="qwen_npu", options={"dump_dir": str(tmp_path / "a")})(torch.randn(2, 16))
    torch.compile(second, backend="qwen_npu", options={"dump_dir": str(tmp_path / "b"), "fusions": "swiglu"})(
        torch.randn(2, 32)
    )
    a = json.loads((tmp_path / "a" / "summary.json").read_text())
    b = json.loads((tmp_path / "b" / "summary.json").read_text())
    assert [g["fusions"] for g in a["graphs"]] == [{"gated_delta_rule": 0, "rms_norm_gated": 0, "moe": 0, "rms_norm": 1, "swiglu": 0, "rotary": 0, "attention": 0}]
    assert a["totals"] == {"gated_delta_rule": 0, "rms_norm_gated": 0, "moe": 0, "rms_norm": 1, "swiglu": 0, "rotary": 0, "attention": 0}
    assert a["variants"] == {"rms_norm_fp32": 1}
    assert [g["fusions"] for g in b["graphs"]] == [{"swiglu": 0}]
    assert b["totals"] == {"swiglu": 0} and b["variants"] == {}
    assert [r["reason"] for r in b["graphs"][0]["refused"]] == ["family 'rms_norm' is disabled (fusions=['swiglu'])"]
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == [a["graphs"][0]["name"], "summary.json"]
    report = json.loads((tmp_path / "a" / a["graphs"][0]["name"] / "report.json").read_text())
    assert report["variants"] == {"rms_norm_fp32": 1}


class _Doubled(torch.autograd.Function):
    """A custom autograd.Function: its graph compiles unfused at the canonicalize stage."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


def test_a_graph_that_falls_back_at_canonicalize_still_dumps_dynamos_graph(npu_ops, tmp_path):
    """captured.py is what debugging a canonicalize fallback needs: written before the retrace (found by a tester)."""
    x = torch.randn(4, 8, requires_grad=True)
    torch.compile(lambda t: _Doubled.apply(t.sin()), backend="qwen_npu", options={"dump_dir": str(tmp_path)})(x).sum().backward()
    (folder,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert sorted(p.name for p in folder.iterdir()) == ["aot_backward.py", "aot_forward.py", "captured.py", "report.json"]
    assert json.loads((folder / "report.json").read_text())["fallback_stage"] == "canonicalize"
    assert "autograd_function_apply" in (folder / "captured.py").read_text()
