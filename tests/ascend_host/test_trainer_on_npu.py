"""The Hugging Face Trainer on the simulated Ascend host: Accelerate finds the NPU by itself (``import torch_npu``,
``torch.npu.is_available()``) and trains on ``npu:0``; ``QwenNpuCompileCallback`` with ``QWEN_NPU_COMPILE=1``
compiles each decoder layer (SDPA, fp32 weights under Trainer's bf16 autocast on ``npu``, which the stand-in
registers as torch_npu does), with the losses of the plain Trainer run."""

from __future__ import annotations

import pytest

pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate (pip install accelerate)")

from qwen_npu_compile.hf_trainer import QwenNpuCompileCallback  # noqa: E402
from qwen_npu_compile.worker import ENV_COMPILE, layer_reports  # noqa: E402
from tests.helpers.trainer import run_trainer  # noqa: E402

STEPS, BATCH, SEQ = 2, 2, 16
PER_LAYER = {"rms_norm": 2, "swiglu": 1, "rotary": 2, "attention": 1}


def train(tmp_path, callbacks=()):
    """fp32 weights under the Trainer's bf16 autocast; Accelerate chooses the NPU by itself."""
    model, losses, trainer = run_trainer(tmp_path, STEPS, BATCH, SEQ, callbacks, bf16=True)
    assert trainer.args.device.type == "npu"
    return model, losses


def test_trainer_callback_on_npu(tmp_path, monkeypatch, npu):
    monkeypatch.delenv(ENV_COMPILE, raising=False)
    reference, expected = train(tmp_path / "off")
    monkeypatch.setenv(ENV_COMPILE, "1")
    callback = QwenNpuCompileCallback()
    model, losses = train(tmp_path / "on", [callback])
    assert next(model.parameters()).device == npu
    assert len(losses) == STEPS and losses == pytest.approx(expected, rel=2e-2)
    assert callback.compiled == ["model.layers.0", "model.layers.1"]
    for name, record in layer_reports(model).items():
        assert record.reports, f"{name} ran no qwen_npu graph"
        for report in record.reports:
            assert {f: n for f, n in report.fusions.items() if n} == PER_LAYER, (name, report.fusions)
        assert record.calls["compiled"] == STEPS and record.calls["eager"] == 0, record.calls
