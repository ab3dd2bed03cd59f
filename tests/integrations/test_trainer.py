"""Hugging Face Trainer: QwenNpuCompileCallback, switched by QWEN_NPU_COMPILE, against the unmodified Trainer run.

2-step Trainer runs of a tiny Qwen2 on the CPU (fp32, SDPA), with and without activation
checkpointing. Needs accelerate (the Trainer does); skipped without it.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate (pip install accelerate)")

from transformers import Qwen2Config, TrainingArguments  # noqa: E402

from qwen_npu_compile.hf_trainer import QwenNpuCompileCallback  # noqa: E402
from qwen_npu_compile.patterns import expected_fusions  # noqa: E402
from qwen_npu_compile.worker import ENV_COMPILE, layer_reports  # noqa: E402
from tests.helpers.trainer import run_trainer  # noqa: E402

PER_LAYER = expected_fusions(Qwen2Config(), per_layer=True)  # one Qwen2 decoder layer graph
STEPS, BATCH, SEQ = 2, 4, 16
#: transformers 5.2x renamed gradient_checkpointing (now a deprecated alias) to activation_checkpointing
CHECKPOINTING = ("activation_checkpointing"
                 if "activation_checkpointing" in {f.name for f in dataclasses.fields(TrainingArguments)}
                 else "gradient_checkpointing")


def train(tmp_path, callbacks=(), checkpointing=False, **arguments):
    """A 2-step Trainer run on the CPU; returns (model, per-step losses)."""
    model, losses, _ = run_trainer(tmp_path, STEPS, BATCH, SEQ, callbacks, use_cpu=True,
                                   **{CHECKPOINTING: checkpointing, **arguments})
    return model, losses


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
def test_callback_compiles_each_layer_and_trains_like_the_plain_trainer(tmp_path, monkeypatch, checkpointing):
    monkeypatch.delenv(ENV_COMPILE, raising=False)
    reference, expected = train(tmp_path / "off", checkpointing=checkpointing)
    monkeypatch.setenv(ENV_COMPILE, "1")
    callback = QwenNpuCompileCallback()
    model, losses = train(tmp_path / "on", [callback], checkpointing=checkpointing)

    assert len(losses) == len(expected) == STEPS and len(set(expected)) == STEPS
    assert losses == pytest.approx(expected, abs=1e-5)
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-5, msg=name)  # same updates: same gradients
    assert callback.compiled == ["model.layers.0", "model.layers.1"]
    for name, record in layer_reports(model).items():
        assert record.reports, f"{name} ran no qwen_npu graph"
        for report in record.reports:
            assert report.fusions == PER_LAYER, (name, report.fusions)
        path = "checkpointed" if checkpointing else "compiled"
        assert record.calls[path] == STEPS and record.calls["eager"] == 0, record.calls


def test_callback_does_nothing_when_switched_off(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_COMPILE, "0")
    callback = QwenNpuCompileCallback()
    model, _ = train(tmp_path, [callback], max_steps=1)
    assert callback.compiled == [] and layer_reports(model) == {}
    assert all(layer._compiled_call_impl is None for layer in model.model.layers)


def test_bad_options_fail_where_the_callback_is_made():
    with pytest.raises(ValueError, match="unknown option"):
        QwenNpuCompileCallback(options={"fusion": "all"})


def test_callback_refuses_whole_model_compile_on_top(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_COMPILE, "1")
    with pytest.raises(ValueError, match="Leave torch_compile, torch_compile_backend and torch_compile_mode unset"):
        train(tmp_path, [QwenNpuCompileCallback()], torch_compile=True, torch_compile_backend="eager")


def test_accelerate_rejects_qwen_npu_as_trainer_compile_backend(tmp_path):
    """Why the callback exists: the Trainer's own torch_compile_backend goes through Accelerate's enum.

    (When this starts failing, Accelerate accepts registered backends and docs/using-the-backend.md's Trainer
    section should say so.)
    """
    with pytest.raises(ValueError, match="not a valid DynamoBackend"):
        train(tmp_path, torch_compile=True, torch_compile_backend="qwen_npu")
