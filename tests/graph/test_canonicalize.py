"""The canonicalize stage (:mod:`qwen_npu_compile.graph.canonicalize`) on graphs it must desugar or give up on: a
torch.vmap-built mask is desugared and fused; a graph the pre-dispatch retrace cannot follow, or one that applies a
custom autograd.Function, compiles unfused with one warning (strict mode raises). The negatives of one family are
in tests/patterns/test_<family>.py; disabled families in tests/fusion/test_disabled_families.py."""

import logging

import pytest
import torch
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

from qwen_npu_compile import get_reports

CORE = {"fusions": "rms_norm,swiglu"}


def _only_report():
    reports = get_reports()
    assert len(reports) == 1
    return reports[0]


class VmapMaskedNorm(torch.nn.Module):
    """Builds a mask with torch.vmap, as transformers 4.5x masking_utils does (canonicalize desugars it)."""

    def __init__(self):
        super().__init__()
        self.norm = Qwen2RMSNorm(8)

    def forward(self, x):
        idx = torch.arange(x.shape[-2])
        mask = torch.vmap(lambda i: idx <= i)(idx)
        return self.norm(x).masked_fill(~mask, 0)


def test_vmap_built_mask_is_desugared_and_fused(npu_ops):
    module, x = VmapMaskedNorm(), torch.randn(2, 8, 8)
    out = torch.compile(module, backend="qwen_npu")(x)
    torch.testing.assert_close(out, module(x))
    report = _only_report()
    assert report.fallback is None and report.fusions["rms_norm"] == 1


def test_graph_that_cannot_be_retraced_runs_unfused_with_a_warning(npu_ops, caplog, monkeypatch):
    from qwen_npu_compile.graph import canonicalize

    def fail(self, node):  # any retrace failure; tests/e2e/test_stack_compat.py covers a failing vmap region
        raise NotImplementedError("simulated retrace failure")

    monkeypatch.setattr(canonicalize._Retracer, "run_node", fail)
    module, x = VmapMaskedNorm(), torch.randn(2, 8, 8)
    with caplog.at_level(logging.WARNING, logger="qwen_npu_compile"):
        out = torch.compile(module, backend="qwen_npu")(x)
    torch.testing.assert_close(out, module(x))
    report = _only_report()
    assert report.fusions["rms_norm"] == 0
    assert "the pre-dispatch retrace failed: NotImplementedError" in report.fallback
    assert "compiling the graph unfused" in caplog.text
    torch._dynamo.reset()
    with pytest.raises(Exception, match="strict mode.*compiled unfused"):
        torch.compile(module, backend="qwen_npu", options={"strict": True})(x)


class _ScaledMatmul(torch.autograd.Function):
    """A custom autograd.Function (as verl's NPUGmmFunction is) with its own backward."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        return grad @ w.t(), x.transpose(-1, -2) @ grad


class _NormThenCustom(torch.nn.Module):
    """HF's RMSNorm, an RMSNorm already fused as a monkey patch would (``torch.ops.npu.npu_rms_norm``, the
    packet), then the custom function."""

    def __init__(self):
        super().__init__()
        self.norm = Qwen2RMSNorm(16)
        self.patched_norm_weight = torch.nn.Parameter(torch.rand(16) + 0.5)
        self.w = torch.nn.Parameter(torch.randn(16, 8))

    def forward(self, x):
        x = torch.ops.npu.npu_rms_norm(self.norm(x), self.patched_norm_weight, 1e-6)[0]
        return _ScaledMatmul.apply(x, self.w)


def test_custom_autograd_function_compiles_unfused_with_its_gradients(npu_ops, caplog):
    """The pre-dispatch retrace keeps a custom autograd.Function's forward only: fused, the parameters it reads
    got no gradient (verl 0.9.1's npu_patch MoE block). The graph compiles unfused instead, with one warning
    naming the source line, and every gradient equals eager's; strict raises naming the stage."""
    torch.manual_seed(0)
    module, x = _NormThenCustom(), torch.randn(2, 4, 16)
    module(x).sum().backward()
    expected = {name: p.grad.clone() for name, p in module.named_parameters()}
    module.zero_grad(set_to_none=True)
    with caplog.at_level(logging.WARNING, logger="qwen_npu_compile"):
        out = torch.compile(module, backend="qwen_npu", options=CORE)(x)
    out.sum().backward()
    for name, p in module.named_parameters():
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, expected[name])
    report = _only_report()
    assert report.fallback_stage == "canonicalize" and "custom torch.autograd.Function at test_canonicalize.py" in report.fallback
    assert report.fusions == {"rms_norm": 0, "swiglu": 0}
    assert report.already_fused == {"rms_norm": 1, "swiglu": 0}  # the patched norm still runs, and is counted
    assert sum("custom torch.autograd.Function" in r.getMessage() for r in caplog.records) == 1
    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"FusionError: qwen_npu strict mode: \S+ compiled unfused \(canonicalize"):
        torch.compile(module, backend="qwen_npu", options={**CORE, "strict": True})(x)
