"""Eager on the simulated npu equals eager on the CPU (the device itself must not change results): tiny Qwen2,
Qwen3-MoE and Qwen3.5 from transformers' own modeling code, forward and backward, fp32 and bf16.

A first such device gave NaN in a tiny Qwen3.5 eager forward; fresh npu memory here is 0xFF (NaN), so a kernel of
the device that leaves memory unwritten fails this test instead of passing by luck."""

from __future__ import annotations

import copy

import pytest
import torch

from qwen_npu_compile.cli.check.harness import run_model
from qwen_npu_compile.cli.check.models import tiny_qwen2
from tests.helpers.models import tiny_hybrid, tiny_moe


def _models():
    return {
        "qwen2": lambda dtype: tiny_qwen2(dtype),
        "qwen3_moe": lambda dtype: tiny_moe("qwen3_moe", dtype),
        "qwen3_5": lambda dtype: tiny_hybrid("qwen3_5", dtype),
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", ["qwen2", "qwen3_moe", "qwen3_5"])
def test_eager_on_npu_equals_eager_on_cpu(npu, family, dtype):
    model = _models()[family](dtype).train()
    torch.manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (2, 24))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # a left-padded row
    on_cpu = run_model(model, model, ids, True, attention_mask=mask)
    on_npu_model = copy.deepcopy(model).to(npu)
    assert all(p.device == npu for p in on_npu_model.parameters())
    logits, grads = run_model(on_npu_model, on_npu_model, ids.to(npu), True, attention_mask=mask.to(npu))
    assert logits.device == npu and torch.isfinite(logits.cpu()).all()
    # not bitwise: on npu SDPA takes its math path (the CPU's fused flash kernel is CPU-only)
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(logits.cpu(), on_cpu[0], **tol)
    assert grads.keys() == on_cpu[1].keys()
    for name, grad in grads.items():
        assert grad.device == npu
        torch.testing.assert_close(grad.cpu(), on_cpu[1][name], **tol, msg=lambda m, n=name: f"{n}: {m}")
