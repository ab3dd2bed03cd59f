"""``recompute="cheap"`` on the simulated Ascend host: the model on ``npu``, torch_npu's ops, the default downstream
torchair (whose AOT step partitions through ``npu_fx_compiler._get_partition_fn``, wrapped for this compile), per
decoder layer as verl runs it (``maybe_compile``, packed rows, ``QWEN_NPU_RECOMPUTE``): losses and every gradient
bit-identical to ``recompute="none"``, the same fusions, each layer graph recomputing its cheap fused ops."""

from __future__ import annotations

import pytest
import torch

from qwen_npu_compile import maybe_compile
from qwen_npu_compile.cli.check.models import tiny_qwen2
from qwen_npu_compile.worker import ENV_COMPILE, layer_reports
from tests.helpers.models import tiny_hybrid


def _step(build, npu, monkeypatch, setting, lengths=(11, 7, 14)):
    monkeypatch.setenv(ENV_COMPILE, "1")
    monkeypatch.setenv("QWEN_NPU_RECOMPUTE", setting)
    torch._dynamo.reset()  # the variable is read when a layer graph compiles
    model = build().to(npu).train()
    maybe_compile(model)
    ids = torch.randint(0, 128, (1, sum(lengths)), generator=torch.Generator().manual_seed(0)).to(npu)
    positions = torch.cat([torch.arange(n) for n in lengths])[None].to(npu)
    logits = model(input_ids=ids, position_ids=positions).logits
    logits.float().square().mean().backward()
    grads = {name: p.grad.cpu() for name, p in model.named_parameters()}
    reports = [report for record in layer_reports(model).values() for report in record.reports]
    return logits.detach().cpu(), grads, reports


@pytest.mark.parametrize("family", ["qwen2", "qwen3_5"])
def test_cheap_recompute_on_npu_is_bit_identical(npu, monkeypatch, family):
    if family == "qwen3_5":
        pytest.importorskip("transformers.models.qwen3_5", reason="Qwen3.5 needs transformers >= 5")

    def build():
        return tiny_qwen2(torch.bfloat16) if family == "qwen2" else tiny_hybrid("qwen3_5", torch.bfloat16)

    logits, grads, none = _step(build, npu, monkeypatch, "none")
    c_logits, c_grads, cheap = _step(build, npu, monkeypatch, "cheap")
    assert torch.equal(logits, c_logits)
    assert all(torch.equal(grads[name], c_grads[name]) for name in grads)
    assert [r.fusions for r in cheap] == [r.fusions for r in none] and all(r.recomputed == {} for r in none)
    for report in cheap:
        norms = report.fusions["rms_norm"] + report.fusions["rms_norm_gated"]
        swiglus = report.fusions["swiglu"] + report.fusions["rms_norm_gated"]
        assert report.recomputed.get("npu::npu_rms_norm", 0) == norms
        assert report.recomputed.get("npu::npu_swiglu", 0) == swiglus
        rotary = sum(n for name, n in report.recomputed.items() if "rotary" in name)
        assert rotary == report.fusions["rotary"]
