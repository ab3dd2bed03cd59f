"""examples/training_curve.py --quick as a user runs it (a fresh process): eager and qwen_npu (per decoder layer,
as verl compiles) train a tiny Qwen2 and a tiny Qwen3.5 on verl-style packed rows to the same losses.

fp32: every step's losses within 1e-4 relative (measured 2.7e-5 at most, Qwen3.5 on its 4th step: the DeltaNet
decay gradients' fp32 rounding, which AdamW's normalised updates amplify). bf16: within 1e-2 relative (measured
5e-4), and qwen_npu's curve no further from the eager fp32 curve than eager bf16's own distance x 2 + 1e-3.
1 min 40 s on the shared 2-core host (load 6-8).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "training_curve.py"
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
FAMILIES = {
    "qwen2": [{"rms_norm": 2, "swiglu": 1, "rotary": 2, "attention": 1}],
    "qwen3_5": [{"gated_delta_rule": 1, "rms_norm_gated": 1, "rms_norm": 2, "swiglu": 1},
                {"rms_norm": 4, "swiglu": 1, "rotary": 2, "attention": 1}],
}


def _run(tmp_path: Path, *flags: str) -> tuple[dict, subprocess.CompletedProcess]:
    out_json, out_png = tmp_path / "curve.json", tmp_path / "curve.png"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--out-json", str(out_json),
         "--out-png", str(out_png) if HAS_MATPLOTLIB else "", *flags],
        capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.splitlines()[-1] == "OK"
    if HAS_MATPLOTLIB:
        assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out_png.stat().st_size > 10_000
    return json.loads(out_json.read_text()), done


def _check_structure(result: dict, dtype: str) -> None:
    assert result["meta"]["dtype"] == dtype and result["meta"]["steps"] == 4
    assert list(result["models"]) == ["qwen2", "qwen3_5"]
    for name, data in result["models"].items():
        assert len(data["eager"]) == len(data["qwen_npu"]) == len(data["abs_delta"]) == 4, name
        assert data["eager_layout"] == ("each sequence its own forward" if name == "qwen3_5" else "packed rows")
        assert all(n >= 2 for n in data["sequences_per_step"])  # packed rows, several sequences each
        assert data["compiled_layers"] == (2 if name == "qwen2" else 4) and not data["layers_without_graph"]
        # every decoder layer ran a fused graph: per layer kind, exactly its families
        assert [g["fusions"] for g in data["graphs"]] == FAMILIES[name], data["graphs"]
        assert all(g["refused"] == 0 and g["fallback"] is None for g in data["graphs"])
        assert data["max_abs_delta"] == max(abs(a - b) for a, b in zip(data["eager"], data["qwen_npu"]))


def test_fp32_curves_match(tmp_path):
    result, done = _run(tmp_path)
    _check_structure(result, "fp32")
    for name, data in result["models"].items():
        assert data["max_rel_delta"] <= 1e-4, (name, data["abs_delta"])
        assert data["eager"][-1] < data["eager"][0]  # it trains
    assert "fused gated_delta_rule 1, rms_norm_gated 1, rms_norm 2, swiglu 1" in done.stdout
    assert "varlen_attention_backward 1" in done.stdout and "chunk_gated_delta_rule_backward 1" in done.stdout
    if not HAS_MATPLOTLIB:
        pytest.skip("matplotlib is not installed: the curves were checked, the PNG was not drawn")


def test_bf16_curves_match_within_bf16s_own_distance(tmp_path):
    result, _ = _run(tmp_path, "--dtype", "bf16", "--reference")
    _check_structure(result, "bf16")
    for name, data in result["models"].items():
        assert data["max_rel_delta"] <= 1e-2, (name, data["abs_delta"])
        ref = data["reference"]
        assert ref["dtype"] == "float32" and len(ref["losses"]) == 4
        assert ref["qwen_npu_max_abs_delta"] <= 2 * ref["eager_max_abs_delta"] + 1e-3, (name, ref)
    if not HAS_MATPLOTLIB:
        pytest.skip("matplotlib is not installed: the curves were checked, the PNG was not drawn")
