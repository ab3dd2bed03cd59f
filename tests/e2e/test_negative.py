"""Fusions that must NOT happen, each refused with a reason and the model source line."""

import logging

import pytest
import torch
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

from qwen_npu_compile.check.models import tiny_qwen2
from qwen_npu_compile import get_reports

CORE = {"fusions": "rms_norm,swiglu"}


class RmsNormLeakingIntermediate(torch.nn.Module):
    """Qwen2RMSNorm's math, but the normalised fp32 activation is also returned."""

    def __init__(self, hidden=32):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(hidden))

    def forward(self, x):
        h = x.to(torch.float32)
        normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * normed.to(x.dtype), normed


class SwiGluLeakingActivation(torch.nn.Module):
    def forward(self, gate, up):
        act = torch.nn.functional.silu(gate)
        return act * up, act.sum()


def _only_report():
    reports = get_reports()
    assert len(reports) == 1
    return reports[0]


def test_intermediate_used_outside_rms_norm_is_not_fused(npu_ops, caplog):
    module = RmsNormLeakingIntermediate()
    x = torch.randn(2, 4, 32)
    with caplog.at_level(logging.WARNING, logger="qwen_npu_compile"):
        out, normed = torch.compile(module, backend="qwen_npu", options=CORE)(x)
    ref_out, ref_normed = module(x)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(normed, ref_normed)
    report = _only_report()
    assert report.fusions["rms_norm"] == 0
    (refusal,) = [r for r in report.refused if r.family == "rms_norm"]
    assert "used outside" in refusal.reason
    assert refusal.source.startswith("test_negative.py:")
    assert "QWEN_NPU_DUMP_DIR" in caplog.text and "rms_norm" in caplog.text


def test_activation_used_outside_swiglu_is_not_fused(npu_ops):
    gate, up = torch.randn(2, 4, 16), torch.randn(2, 4, 16)
    torch.compile(SwiGluLeakingActivation(), backend="qwen_npu", options=CORE)(gate, up)
    report = _only_report()
    assert report.fusions["swiglu"] == 0
    (refusal,) = [r for r in report.refused if r.family == "swiglu"]
    assert "used outside" in refusal.reason


def test_rms_norm_dtype_pair_outside_the_kernel_is_refused(npu_ops):
    norm = Qwen2RMSNorm(32).to(torch.bfloat16)
    x = torch.randn(2, 4, 32, dtype=torch.float16)
    out = torch.compile(norm, backend="qwen_npu", options=CORE)(x)
    torch.testing.assert_close(out, norm(x))
    report = _only_report()
    assert report.fusions["rms_norm"] == 0
    (refusal,) = report.refused
    assert refusal.family == "rms_norm"
    assert "unsupported dtype pair" in refusal.reason and "float16" in refusal.reason
    assert refusal.source.startswith("modeling_qwen2.py:")


def test_swiglu_dtype_mismatch_is_refused(npu_ops):
    def mlp(gate, up):
        return torch.nn.functional.silu(gate) * up

    gate, up = torch.randn(2, 8, dtype=torch.float16), torch.randn(2, 8, dtype=torch.bfloat16)
    torch.testing.assert_close(torch.compile(mlp, backend="qwen_npu", options=CORE)(gate, up), mlp(gate, up))
    (refusal,) = _only_report().refused
    assert refusal.family == "swiglu" and "dtype mismatch" in refusal.reason


def test_disabled_family_fuses_nothing_and_says_why(npu_ops):
    model = tiny_qwen2().eval()
    ids = torch.randint(0, 128, (1, 8))
    with torch.no_grad():
        torch.compile(model, backend="qwen_npu", options={"fusions": "rms_norm"})(ids)
    report = _only_report()
    assert report.families == ["rms_norm"]
    assert report.fusions == {"rms_norm": 5}
    swiglu = [r for r in report.refused if r.family == "swiglu"]
    assert len(swiglu) == 2
    assert all("disabled" in r.reason and r.source.startswith("modeling_qwen2.py:") for r in swiglu)


def test_strict_mode_names_family_reason_and_source(npu_ops):
    module = RmsNormLeakingIntermediate()
    with pytest.raises(Exception, match=r"strict mode(.|\n)*rms_norm: near miss(.|\n)*test_negative.py:\d+"):
        torch.compile(module, backend="qwen_npu", options={**CORE, "strict": True})(torch.randn(2, 4, 32))


def test_strict_mode_ignores_disabled_families(npu_ops):
    model = tiny_qwen2().eval()
    with torch.no_grad():
        torch.compile(model, backend="qwen_npu", options={"fusions": "rms_norm", "strict": "1"})(torch.randint(0, 128, (1, 8)))
    assert _only_report().fusions == {"rms_norm": 5}


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
    from qwen_npu_compile import canonicalize

    def fail(self, node):  # any retrace failure; tests/test_stack_compat.py covers a failing vmap region
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
