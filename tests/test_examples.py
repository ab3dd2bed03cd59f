"""The examples run as a user runs them (a fresh process) and print what their docstrings say."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.helpers import REPO

EXAMPLES = REPO / "examples"


def test_from_pretrained_train_loads_a_saved_folder_and_trains_one_step():
    """save_pretrained -> from_pretrained -> torch.compile(backend="qwen_npu") -> one AdamW step: the loss drops on
    the batch it trained on, and the training graph of the tiny 2-layer Qwen2 holds exactly its fusions."""
    done = subprocess.run([sys.executable, str(EXAMPLES / "from_pretrained_train.py")], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0].startswith("from_pretrained(") and "tiny-qwen2" in lines[0]
    assert "qwen2, 2 layers, npu ops simulated" in lines
    before, after = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+) after one AdamW step", done.stdout).groups())
    assert after < before
    assert ("fusions: gated_delta_rule 0, rms_norm_gated 0, rms_norm 5, moe 0, swiglu 2, rotary 4, attention 2"
            in lines), lines
    assert lines[-1] == "OK"
