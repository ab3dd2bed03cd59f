"""Shared fixtures: a clean Dynamo/qwen_npu state per test, tiny Qwen2 models, compile helpers."""

from __future__ import annotations

import pytest
import torch
import transformers

from qwen_npu_compile import ensure_npu_ops
from qwen_npu_compile.report import SUMMARY

#: Relative parity tolerances of the tests: max|compiled - eager| / max|eager|.
RTOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


@pytest.fixture(autouse=True)
def _clean_state():
    torch._dynamo.reset()
    SUMMARY.clear()
    torch.manual_seed(0)
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="session")
def npu_ops():
    return ensure_npu_ops()


@pytest.fixture(scope="session")
def simulated_npu_ops(npu_ops):
    """For tests of the CPU stand-ins themselves: skipped where the real torch_npu is present."""
    if not npu_ops.simulated:
        pytest.skip("real torch_npu present: these tests check the CPU stand-ins")
    return npu_ops


def tiny_qwen2_config(**overrides) -> transformers.Qwen2Config:
    """A 2-layer Qwen2 (hidden 64, 4 heads, 2 KV heads: GQA, head_dim 16) with no KV cache."""
    fields = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128, max_position_embeddings=256, use_cache=False,
    )
    fields.update(overrides)
    return transformers.Qwen2Config(**fields)


def tiny_qwen2(dtype=torch.float32, attn="sdpa", **overrides) -> transformers.Qwen2ForCausalLM:
    """A random-weight tiny Qwen2ForCausalLM from transformers' real modeling code."""
    torch.manual_seed(0)
    config = tiny_qwen2_config(**overrides)
    model = transformers.Qwen2ForCausalLM._from_config(config, attn_implementation=attn)
    return model.to(dtype)


def run_model(model, runner, input_ids, train: bool, **kwargs):
    """Forward (and LM-loss backward); returns ``(fp32 logits, {param name: grad})``."""
    model.zero_grad(set_to_none=True)
    with torch.set_grad_enabled(train):
        out = runner(input_ids=input_ids, labels=input_ids if train else None, **kwargs)
        if train:
            out.loss.backward()
    grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach().float(), grads


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected.float()).abs().max() / expected.float().abs().max().clamp_min(1e-30)).item()


def assert_parity(model, input_ids, train: bool, dtype, options=None, dynamic=None, **kwargs):
    """Compile ``model`` with qwen_npu, compare logits and gradients against eager; return the reports."""
    eager_logits, eager_grads = run_model(model, model, input_ids, train, **kwargs)
    compiled = torch.compile(model, backend="qwen_npu", options=options or {}, dynamic=dynamic)
    logits, grads = run_model(model, compiled, input_ids, train, **kwargs)
    assert rel_err(logits, eager_logits) <= RTOL[dtype], rel_err(logits, eager_logits)
    if train:
        assert set(grads) == set(eager_grads)
        worst = max(rel_err(grads[n], eager_grads[n]) for n in grads)
        assert worst <= 5 * RTOL[dtype], worst
    return list(SUMMARY.graphs)
