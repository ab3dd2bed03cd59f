"""A short Hugging Face Trainer run of the tiny Qwen2 (needs accelerate, as the Trainer does)."""

from __future__ import annotations

import torch


class TokenRows(torch.utils.data.Dataset):
    """``rows`` random rows of ``seq`` tokens (seed 0), each its own labels."""

    def __init__(self, rows: int, seq: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.rows = [torch.randint(0, 128, (seq,), generator=generator) for _ in range(rows)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index):
        return {"input_ids": self.rows[index], "labels": self.rows[index]}


def run_trainer(output_dir, steps: int, batch: int, seq: int, callbacks=(), **arguments):
    """``steps`` Trainer steps of a fresh tiny Qwen2 (fp32 weights) on :class:`TokenRows`, no saving, no workers;
    ``arguments`` go to ``TrainingArguments``. Returns ``(model, per-step losses, trainer)``."""
    from transformers import Trainer, TrainingArguments

    from qwen_npu_compile.cli.check.models import tiny_qwen2

    model = tiny_qwen2()
    settings = dict(output_dir=str(output_dir), per_device_train_batch_size=batch, max_steps=steps, learning_rate=1e-3,
                    logging_steps=1, save_strategy="no", report_to=[], seed=0, dataloader_num_workers=0)
    trainer = Trainer(model=model, args=TrainingArguments(**{**settings, **arguments}),
                      train_dataset=TokenRows(steps * batch, seq), callbacks=list(callbacks))
    trainer.train()
    return model, [entry["loss"] for entry in trainer.state.log_history if "loss" in entry], trainer
