"""The Hugging Face Trainer on the simulated Ascend host: Accelerate finds the NPU by itself (``import torch_npu``,
``torch.npu.is_available()``) and trains on ``npu:0``; ``QwenNpuCompileCallback`` with ``QWEN_NPU_COMPILE=1``
compiles each decoder layer (SDPA, fp32 weights under Trainer's bf16 autocast on ``npu``, which the stand-in
registers as torch_npu does), with the losses of the plain Trainer run."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate (pip install accelerate)")

from transformers import Trainer, TrainingArguments  # noqa: E402

from qwen_npu_compile.cli.check.models import tiny_qwen2  # noqa: E402
from qwen_npu_compile.hf_trainer import QwenNpuCompileCallback  # noqa: E402
from qwen_npu_compile.worker import ENV_COMPILE, layer_reports  # noqa: E402

STEPS, BATCH, SEQ = 2, 2, 16
PER_LAYER = {"rms_norm": 2, "swiglu": 1, "rotary": 2, "attention": 1}


class Tokens(torch.utils.data.Dataset):
    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        self.rows = [torch.randint(0, 128, (SEQ,), generator=generator) for _ in range(STEPS * BATCH)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index):
        return {"input_ids": self.rows[index], "labels": self.rows[index]}


def train(tmp_path, callbacks=()):
    model = tiny_qwen2()  # fp32 weights, bf16 autocast (Trainer's bf16=True)
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=BATCH, max_steps=STEPS,
                             learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to=[], seed=0,
                             dataloader_num_workers=0, bf16=True)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=list(callbacks))
    assert trainer.args.device.type == "npu"  # Accelerate chose the NPU by itself
    trainer.train()
    return model, [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


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
